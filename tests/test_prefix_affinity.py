"""Prefix affinity: a task's repeats go to the replica that served it before, so the engine's prefix cache
computes its prompt once; the simulator counts hits as vLLM does, and the report shows the hit rate."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from rollout_data import assert_complete, write_rows

from rollflow.infra.local import spawn_simulator
from rollflow.tasks.backends.endpoints import EndpointPool
from rollflow.tasks.backends.limiter import ConcurrencyLimit

REPEATS = 4


def _hit_rate(report: dict) -> float:
    rates = [row["engine"]["prefix_cache_hit_rate"] for row in report["endpoints"]]
    assert all(rate is not None for rate in rates), report["endpoints"]
    return sum(rates) / len(rates)


@pytest.mark.alone  # hit rate and load spread follow timing
def test_affinity_raises_the_prefix_cache_hit_rate_over_two_replicas(run_cli, tmp_path: Path) -> None:
    """The same rows over two replicas, with and without affinity. At most 3 of a task's 4 repeats can
    hit (the first computes the prompt); with affinity the rate comes near that, without it each replica
    computes most prompts once."""
    sims = [
        spawn_simulator("--profile", "batching", "--prefill-tokens", "64", "--seed", str(i)) for i in (1, 2)
    ]
    inp = write_rows(tmp_path / "rows.jsonl", 600)
    reports = {}
    try:
        for affinity in ("true", "false"):
            out = tmp_path / f"out-{affinity}"
            res = run_cli(
                "run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent", "--backend-url",
                ",".join(s.url for s in sims), "--num-repeats", str(REPEATS), "--parallelism", "32",
                "--no-progress", env={"ROLLFLOW_BACKEND__PREFIX_AFFINITY": affinity},
            )  # fmt: skip
            assert res.returncode == 0, res.stderr[-3000:]
            reports[affinity] = orjson.loads((out / "report.json").read_bytes())
            assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), 600, REPEATS)
    finally:
        for sim in sims:
            sim.stop()
    with_it, without = _hit_rate(reports["true"]), _hit_rate(reports["false"])
    assert with_it <= (REPEATS - 1) / REPEATS + 0.01
    assert with_it >= 0.65 and with_it >= without + 0.1, (with_it, without)
    assert "prefix hits" in (tmp_path / "out-true" / "report.md").read_text()
    served = [row["rollouts"] for row in reports["true"]["endpoints"]]
    assert min(served) >= 0.4 * sum(served), served  # affinity keeps the load spread


def test_a_busy_replica_is_not_waited_for() -> None:
    """Affinity yields to load: once the task's replica carries a quarter of its limit more than the
    least loaded, the attempt goes to the least loaded (and that one becomes the task's)."""
    pool = EndpointPool(["http://a", "http://b"], {"http://a": 8, "http://b": 8}, ConcurrencyLimit(16))
    a, b = pool.endpoint("http://a"), pool.endpoint("http://b")
    assert pool.choose(task=7) is a
    pool.begin(a)
    assert pool.choose(task=7) is a  # 1 outstanding against 0: within the slack of 2
    for _ in range(2):
        pool.begin(a)
    assert pool.choose(task=7) is b  # 3 against 0: past it
    assert pool.choose(task=7) is b and pool.choose(task=8) is b  # 7 now lives on b; 8 goes least loaded
    assert pool.affine == 2


def test_a_controller_does_not_take_affinitys_slack_for_draining() -> None:
    """Affinity may carry a replica a quarter past its share; its controller still grows it."""
    from rollflow.tasks.tuning.engine_control import EngineOptions, EngineState, Reading, decide

    state, opts = EngineState(limit=36), EngineOptions()
    for _ in range(2):
        limit, why = decide(state, Reading(1, 38.0, 0.0, 0.2, 0, 38, ended=38), opts)  # a turnover each
    assert limit > 36, why
    assert "draining" in decide(EngineState(limit=36), Reading(1, 30.0, 0.0, 0.2, 0, 46), opts)[1]
