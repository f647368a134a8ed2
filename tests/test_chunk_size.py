"""`--chunk-size auto`: 1,000 rows a chunk on every runner (fewer when they make more than 5,000 rollouts),
and a resumed run keeps the chunks it was planned with, whichever runner resumes it. A number given keeps
its meaning: a different one than the run's is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from rollout_data import write_rows

from rollflow.settings import RollflowSettings, RunSpec
from rollflow.tasks.collect.plan import RunPlan, plan_run
from rollflow.tasks.collect.runtime import open_run
from rollflow.tasks.storage.ledger import IdentityMismatch

pytestmark = pytest.mark.concurrent


def plan(tmp_path: Path, rows: int = 12_000, **fields: Any) -> RunPlan:
    tmp_path.mkdir(exist_ok=True)
    inp = tmp_path / "in.jsonl"
    if not inp.exists():
        write_rows(inp, rows)
    collection = {k: fields.pop(k) for k in ("chunk_size", "num_repeats") if k in fields}
    spec = RunSpec(
        input=str(inp),
        output=str(tmp_path / "out"),
        backend={"kind": "agent", "url": "http://127.0.0.1:9", "model": "m"},
        collection=collection,
        **fields,
    )
    handles = open_run(spec, RollflowSettings())
    return plan_run(spec, handles.store, handles.ledger, handles.input_options, None)


def sizes(p: RunPlan) -> list[int]:
    return [c.good_rows for c in p.scan.chunks]


def test_auto_is_the_default_and_plans_a_thousand_rows_locally(tmp_path: Path) -> None:
    p = plan(tmp_path, rows=2500)
    assert p.identity.chunk_size == 1000 and sizes(p) == [1000, 1000, 500]


@pytest.mark.parametrize(("runner", "repeats"), [("dask", 1), ("ray", 4)])
def test_auto_on_a_cluster_plans_a_thousand_rows_too(tmp_path: Path, runner: str, repeats: int) -> None:
    """A remote chunk's dispatch is now a few hundredths of a second, so clusters need no larger chunks."""
    p = plan(tmp_path, runner=runner, chunk_size="auto", num_repeats=repeats)
    assert p.identity.chunk_size == 1000 and sizes(p) == [1000] * 12


@pytest.mark.parametrize(
    ("runner", "repeats", "rows"), [("dask", 40, 125), ("local", 64, 79), ("ray", 6, 834)]
)
def test_auto_with_many_repeats_plans_at_most_five_thousand_rollouts(tmp_path: Path, runner, repeats, rows):
    """200 prompts x 40 repeats used to be one chunk of 8,000 rollouts: all of it on one worker."""
    p = plan(tmp_path, rows=2000, runner=runner, chunk_size="auto", num_repeats=repeats)
    assert p.identity.chunk_size == rows and sizes(p)[0] == rows and sum(sizes(p)) == 2000
    assert rows * repeats >= 5000 > (rows - 1) * repeats


def test_a_resumed_run_keeps_its_chunks_on_another_runner(tmp_path: Path) -> None:
    first = plan(tmp_path, runner="dask", chunk_size=700)
    again = plan(tmp_path, runner="local")  # auto: the run's own chunks, not the default
    assert again.identity.run_id == first.identity.run_id and again.identity.chunk_size == 700
    other = plan(tmp_path / "other", rows=12_000, chunk_size=1500)
    resumed_on_ray = plan(tmp_path / "other", runner="ray")
    assert (
        resumed_on_ray.identity.run_id == other.identity.run_id and resumed_on_ray.identity.chunk_size == 1500
    )


def test_a_number_other_than_the_runs_is_refused_by_name_and_restart_replans(tmp_path: Path) -> None:
    plan(tmp_path, runner="dask", chunk_size=5000)
    with pytest.raises(IdentityMismatch, match="chunk_size 5000 -> 700"):
        plan(tmp_path, chunk_size=700)
    restarted = plan(tmp_path, restart=True)  # auto with --restart: the default, a new run
    assert restarted.identity.chunk_size == 1000


def test_the_cli_takes_auto_or_a_number_and_refuses_words(run_cli, simulator, tmp_path: Path) -> None:
    inp = write_rows(tmp_path / "in.jsonl", 10)
    res = run_cli("run", "--input", str(inp), "--output", str(tmp_path / "o"), "--chunk-size", "many")
    assert res.returncode == 2 and "expected a number of input rows or auto, not 'many'" in res.stderr
    res = run_cli("run", "--input", str(inp), "--output", str(tmp_path / "o"), "--chunk-size", "0")
    assert res.returncode == 2 and "expected a number of input rows or auto, not '0'" in res.stderr
    out = tmp_path / "auto"
    res = run_cli("run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent",
                  "--backend-url", simulator, "--parallelism", "4", "--chunk-size", "auto",
                  "--no-progress")  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["chunk_size"] == 1000 and report["spec"]["collection"]["chunk_size"] == "auto"
    assert orjson.loads((out / "run.json").read_bytes())["chunk_size"] == 1000
