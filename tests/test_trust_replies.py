"""Every rollout is a row or a failure with a reason, whatever the backend answers (end to end over HTTP)."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path
from typing import Any

import orjson
from rollout_data import write_rows

from rollflow.infra.local import spawn_simulator
from rollflow.settings import BackendSettings, CollectionSettings, VerifySettings
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.backends.limiter import ConcurrencyLimit
from rollflow.tasks.collect.rollouts import CollectContext, RolloutBatch, run_rollouts
from rollflow.tasks.storage.ledger import Ledger
from rollflow.tasks.storage.store import Store
from rollflow.tasks.verify.verifiers import make_verifier


def _args(inp: Path, out: Path, url: str, *extra: str) -> list[str]:
    return [
        "run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent", "--backend-url", url,
        "--num-repeats", "2", "--parallelism", "8", "--chunk-size", "10", "--no-progress",
        "--max-retries", "0", *extra,
    ]  # fmt: skip


def _failures(out: Path) -> list[dict[str, Any]]:
    return [
        orjson.loads(line)
        for p in sorted((out / "failures").glob("*.jsonl"))
        for line in p.read_bytes().splitlines()
    ]


def _run_requests(url: str) -> int:
    return orjson.loads(urllib.request.urlopen(f"{url}/stats", timeout=10).read())["endpoints"].get("run", 0)


def test_error_objects_and_null_rewards_fail_and_the_next_run_redoes_only_them(run_cli, fast_sim, tmp_path):
    """A 200 error object or a null reward is a failure with its reason, never a reward-0 row; the same
    command against a healthy backend then requests exactly the failed rollouts and publishes."""
    faulty = spawn_simulator(
        "--latency-ms",
        "1",
        "--slots",
        "64",
        "--fault-rate",
        "0.3",
        "--fault-kinds",
        "error_object,null_reward",
    )
    try:
        inp, out = write_rows(tmp_path / "in.jsonl", 40), tmp_path / "out"
        res = run_cli(*_args(inp, out, faulty.url))
        assert res.returncode == 1, res.stderr
        assert not (out / "rollouts.jsonl").exists()
        failures = _failures(out)
        kinds = {f["error"]["kind"] for f in failures}
        assert kinds == {"malformed"} and len(failures) > 5, kinds
        messages = " ".join(f["error"]["message"] for f in failures)
        assert "injected error object" in messages and "reward is None" in messages
        committed = [
            orjson.loads(line)
            for p in (out / "chunks").glob("*.jsonl")
            for line in p.read_bytes().splitlines()
        ]
        assert all(isinstance(r["reward"], float) for r in committed)
        assert len(committed) + len(failures) == 80
        before = _run_requests(fast_sim.url)
        res = run_cli(*_args(inp, out, fast_sim.url))
        assert res.returncode == 0, res.stderr
        assert _run_requests(fast_sim.url) - before == len(failures)
        rows = (out / "rollouts.jsonl").read_bytes().splitlines()
        assert len(rows) == 80 and not _failures(out)
    finally:
        faulty.stop()


async def test_a_rollout_whose_request_cannot_be_built_is_a_failure_and_workers_go_on(fast_sim, tmp_path):
    """Rows the chat conversion cannot send (plain strings in `input`, a row too deep to encode) each end
    as one failure with a reason; every other rollout completes at the full parallelism."""
    ledger = Ledger(Store(str(tmp_path / "out")))
    backend = BackendSettings(kind="chat", url=fast_sim.url, max_retries=0)
    verifier = make_verifier(VerifySettings(verifier="exact_match"))
    ctx = CollectContext(
        ledger, "", {}, backend, CollectionSettings(num_repeats=1), verifier, ConcurrencyLimit(4)
    )
    deep: Any = "x"
    for _ in range(300):
        deep = [deep]
    bad = [
        {"responses_create_params": {"input": ["plain", "strings"]}},
        {"responses_create_params": {"input": "hi"}, "deep": deep},
    ] * 4
    good = {"responses_create_params": {"input": "What is 2 + 2?"}, "expected_answer": "4"}
    items = [(i, row, 0) for i, row in enumerate(bad)] + [(100 + i, good, 0) for i in range(40)]
    batch = RolloutBatch()
    try:
        await asyncio.wait_for(run_rollouts(ctx, items, batch), 30)
    finally:
        await close_loop_session()  # the loop's session holds its connections until closed
    assert len(batch.results) == 40 and len(batch.failures) == 8
    for key, line in batch.failures.items():
        error = orjson.loads(line)["error"]
        assert error["kind"] == "rollout_error" and error["message"], (key, error)
    assert ctx.limit.in_use == 0
