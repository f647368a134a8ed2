"""Diagnosis and tuning with the engine's own signal (the simulator's vLLM or SGLang /metrics) against
a backend of the same slots without it (`--metrics-format none`): what the verdict says, where the search
stops, and how many probe rollouts it takes."""

from __future__ import annotations

import pytest
from tuning_support import setup_run

from rollflow.infra.local import spawn_simulator
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.tuning.diagnose import Diagnosis, diagnose
from rollflow.tasks.tuning.probe import ProbeFeed
from rollflow.tasks.tuning.tune import TuneOptions, Tuning, step_rollouts, tune
from rollflow.tasks.tuning.tune_rules import engine_step_rollouts


async def diagnose_and_tune(tmp_path, url: str, rows: int = 3000) -> tuple[Diagnosis, Tuning]:  # type: ignore[no-untyped-def]
    """Diagnosis then tuning against the simulator at `url`; the caller closes the loop's session."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    s = setup_run(tmp_path, url, rows=rows)
    feed = ProbeFeed(s.ctx, s.plan)
    try:
        d = await diagnose(s.ctx, s.plan, feed=feed)
        t = await tune(s.ctx, s.plan, TuneOptions(), feed=feed, seeds=[d.low, d.high])
    finally:
        feed.close()
    return d, t


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
async def test_verdict_names_the_engine_queue(tmp_path, fmt: str) -> None:
    sim = spawn_simulator("--slots", "4", "--latency-ms", "40", "--metrics-format", fmt)
    try:
        s = setup_run(tmp_path, sim.url, rows=400, chunk_size=100)
        d = await diagnose(s.ctx, s.plan, low=5, high=20, rows=100)
        await close_loop_session()
    finally:
        sim.stop()
    assert d.verdict == "backend-bound"
    assert "backend saturated: " in d.reason and "requests waiting, KV cache 100% used" in d.reason
    engine = d.as_dict()["engine"]
    assert engine["20"]["saturated"] and engine["20"]["running_max"] == 4
    assert 10 <= engine["20"]["waiting_max"] <= 16  # 20 in flight, 4 served; a reply or two in transit


async def test_verdict_says_the_engine_is_not_the_limit(tmp_path) -> None:
    sim = spawn_simulator("--slots", "64", "--latency-ms", "40")
    try:
        s = setup_run(tmp_path, sim.url, rows=400, chunk_size=100)
        d = await diagnose(s.ctx, s.plan, low=5, high=20, rows=100)
        await close_loop_session()
    finally:
        sim.stop()
    assert d.verdict == "parallelism-bound"
    assert "of 20 running, none waiting" in d.reason and not d.as_dict()["engine"]["20"]["saturated"]


async def test_the_search_stops_at_the_engine_queue_on_short_steps(tmp_path) -> None:
    # 400 ms rollouts: a short step lasts about a second, so its mid-step /metrics sample lands while the
    # queue stands even on a loaded machine (at 50 ms a step lasted ~75 ms and a late sample missed it).
    # The backend without /metrics, compared by probe rollouts only, has the same 32 slots at 50 ms: the
    # 400 ms are for a mid-step sample, of which it has none, and the rate rules size each step in rollouts
    # from the parallelism (step_rollouts) whatever the latency; at 400 ms it took 31 s, at 50 ms ~5.
    with_metrics = spawn_simulator("--slots", "32", "--latency-ms", "400")
    try:
        d_on, on = await diagnose_and_tune(tmp_path / "on", with_metrics.url)
    finally:
        await close_loop_session()
        with_metrics.stop()
    without = spawn_simulator("--slots", "32", "--latency-ms", "50", "--metrics-format", "none")
    try:
        d_off, off = await diagnose_and_tune(tmp_path / "off", without.url)
    finally:
        await close_loop_session()
        without.stop()
    assert on.stop_reason == "engine queue" and on.engine is not None and on.engine["knee_from_engine"]
    assert on.knee == 32 and on.chosen_parallelism == 40 and on.stable  # 25% over: a short queue
    assert on.steps[-1].phase == "stability" and on.steps[-1].note == "engine confirmation"
    # short search steps above the diagnosis (20 -> 40 queues while throughput still grew, 80 queues with
    # none gained) and one short confirmation at the choice
    opts = TuneOptions()
    short = engine_step_rollouts(40, opts) + engine_step_rollouts(80, opts)
    short += engine_step_rollouts(40, opts, confirm=True)
    assert on.probe_rollouts == short < step_rollouts(40, opts) + step_rollouts(40, opts, stability=True)
    assert d_on.probe_rollouts + on.probe_rollouts < d_off.probe_rollouts + off.probe_rollouts
    # without metrics (what test_without_metrics_the_report_has_no_engine checked on 8 slots x 50 ms): no
    # engine anywhere in the diagnosis, the tuning or its steps, and the rate rules decide
    assert "engine" not in d_off.as_dict() and "backend saturated" not in d_off.reason
    assert "engine" not in off.as_dict() and off.stop_reason != "engine queue" and off.engine is None
    assert all("engine" not in step for step in off.as_dict()["steps"])
