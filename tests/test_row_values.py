"""Rows are checked once, at plan time, for the backend kind; every value reaches the dataset unchanged."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_errors import args_for, one_paragraph

from rollflow.settings import BackendSettings, CollectionSettings
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.backends.limiter import ConcurrencyLimit
from rollflow.tasks.collect.rollouts import CollectContext, RolloutBatch, run_rollouts
from rollflow.tasks.collect.rows import iter_chunk_rows, scan_input
from rollflow.tasks.storage.ledger import Ledger
from rollflow.tasks.storage.rowjson import MAX_ROW_DEPTH
from rollflow.tasks.storage.store import Store

ROLLOUT_FIELDS = {"response", "reward", "_ng_task_index", "_ng_rollout_index", "_rf"}


def nest(levels: int, leaf: Any = 1) -> Any:
    for _ in range(levels):
        leaf = [leaf]
    return leaf


def row(i: int, **extra: Any) -> dict[str, Any]:
    return {
        "responses_create_params": {"input": f"What is {i} + {i}?"},
        "expected_answer": str(2 * i),
        **extra,
    }


def write(path: Path, rows: list[Any]) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return path


def test_chat_row_the_conversion_cannot_send_is_refused_at_plan_time(run_cli, fast_sim, tmp_path):
    inp = write(tmp_path / "in.jsonl", [row(0), row(1), {"responses_create_params": {"input": ["a", "b"]}}])
    out = tmp_path / "out"
    args = [a if a != "agent" else "chat" for a in args_for(inp, out, fast_sim.url)]
    res = run_cli(*args, "--verifier", "exact_match")
    assert res.returncode == 2, res.stderr
    message = one_paragraph(res.stderr)
    assert f"{inp}, line 3" in message and "--backend-kind chat cannot send this row" in message
    assert "input item 0: a str has no chat equivalent" in message
    assert not (out / "chunks").exists()


def test_too_deep_row_is_refused_or_skipped_never_a_dead_chunk(run_cli, fast_sim, tmp_path):
    deep = row(1, meta=nest(MAX_ROW_DEPTH + 5))
    inp = write(tmp_path / "in.jsonl", [row(0), deep, row(2)])
    res = run_cli(*args_for(inp, tmp_path / "refused", fast_sim.url))
    assert res.returncode == 2, res.stderr
    assert f"{inp}, line 2" in one_paragraph(res.stderr) and "nests deeper than" in res.stderr
    out = tmp_path / "out"
    res = run_cli(*args_for(inp, out, fast_sim.url, "--skip-bad-rows"))
    assert res.returncode == 0, res.stderr
    bad = [orjson.loads(x) for x in (out / "bad_rows.jsonl").read_bytes().splitlines()]
    assert [(b["line"], b["task_index"]) for b in bad] == [(2, 1)] and "nests deeper" in bad[0]["error"]
    tasks = [orjson.loads(x)["_ng_task_index"] for x in (out / "rollouts.jsonl").read_bytes().splitlines()]
    assert tasks == [0, 2]


def test_big_integers_and_floats_are_published_exactly(run_cli, fast_sim, tmp_path):
    """An expected_answer of 2**100 is scored against its own digits and published as written."""
    rows = [
        {
            "responses_create_params": {"input": "2**100?", "metadata": {"id": 2**80}},
            "expected_answer": 2**100,
            "ids": [-(2**64), 2**64, 18446744073709551615],
            "floats": [0.1, 1e-300, 1.5e300, -0.0, 2.0],
        },
        row(1),
    ]
    inp, out = write(tmp_path / "in.jsonl", rows), tmp_path / "out"
    res = run_cli(*args_for(inp, out, fast_sim.url))
    assert res.returncode == 0, res.stderr
    published = [json.loads(x) for x in (out / "rollouts.jsonl").read_bytes().splitlines()]
    for got, want in zip(published, rows, strict=True):
        assert same(strip(got), want), (strip(got), want)
    assert b"1267650600228229401496703205376" in (out / "rollouts.jsonl").read_bytes()


def strip(published: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in published.items() if k not in ROLLOUT_FIELDS}


def same(a: Any, b: Any) -> bool:
    """Equal value for value and type for type (1 is not 1.0, -0.0 is not 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return repr(a) == repr(b)


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=16,
)
ROWS = st.fixed_dictionaries(
    {
        "responses_create_params": st.fixed_dictionaries({"input": st.text(max_size=20), "metadata": VALUES}),
        "payload": VALUES,
        "deep": st.integers(0, MAX_ROW_DEPTH - 2).map(nest),
    },
    optional={"expected_answer": SCALARS},
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(ROWS, min_size=1, max_size=6))
def test_every_generated_row_reaches_the_dataset_value_for_value(fast_sim, tmp_path, rows):
    """The row path as a chunk runs it: the plan's scan, the chunk's read, the agent over HTTP, the line."""
    inp = write(tmp_path / "gen.jsonl", rows)
    scan = scan_input(str(inp), chunk_size=100, limit=None, skip_bad_rows=False)
    read = [r for c in scan.chunks for _, r in iter_chunk_rows(str(inp), c)]
    backend = BackendSettings(kind="agent", url=fast_sim.url, max_retries=0)
    ctx = CollectContext(
        Ledger(Store(str(tmp_path / "out"))), str(inp), {}, backend, CollectionSettings(num_repeats=1), None,
        ConcurrencyLimit(4),
    )  # fmt: skip
    batch = RolloutBatch()

    async def collect() -> None:
        try:
            await asyncio.wait_for(run_rollouts(ctx, [(i, r, 0) for i, r in enumerate(read)], batch), 30)
        finally:
            await close_loop_session()

    asyncio.run(collect())
    assert not batch.failures, list(batch.failures.values())[:1]
    for i, want in enumerate(rows):
        got = json.loads(batch.results[(i, 0)])
        assert same(strip(got), want), (strip(got), want)
