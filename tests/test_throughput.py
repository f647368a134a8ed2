"""Steady throughput from request timelines: synthetic closed loops with known rates, and a real simulator."""

from __future__ import annotations

import pytest
from tuning_support import closed_loop, setup_run

from rollflow.infra.local import spawn_simulator
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.collect.rollouts import RequestRecord
from rollflow.tasks.tuning.probe import ProbeFeed, probe_step
from rollflow.tasks.tuning.throughput import measure_step, percentiles
from rollflow.tasks.tuning.tune import TuneOptions, step_rollouts


@pytest.mark.parametrize(
    ("parallelism", "slots", "n"),
    [
        (5, 64, 100),
        (20, 64, 100),
        (32, 32, 100),
        (40, 32, 100),
        (64, 32, 200),
        (128, 128, 384),
        (160, 128, 480),
    ],
)
def test_short_steps_measure_the_steady_rate(parallelism: int, slots: int, n: int) -> None:
    latency = 0.05
    truth = min(parallelism, slots) / latency
    m = measure_step(closed_loop(n, parallelism, slots, latency), parallelism)
    assert m.method == "progress"
    assert m.rollouts_per_s == pytest.approx(truth, rel=0.05)


def test_errors_by_kind_and_percentiles() -> None:
    records = closed_loop(100, 10, 100, 0.1)
    for i in (3, 50, 70):
        records[i] = RequestRecord(records[i].start, records[i].end, "http_429")
    records[80] = RequestRecord(records[80].start, records[80].end, "timeout")
    m = measure_step(records, 10)
    assert m.errors == {"http_429": 3, "timeout": 1} and m.ok == 96 and m.error_count == 4
    assert m.rollouts_per_s == pytest.approx(100 * 0.96, rel=0.05)
    assert percentiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (3.0, pytest.approx(4.8))
    assert measure_step([], 4).rollouts == 0


def test_too_short_falls_back_to_span() -> None:
    m = measure_step(closed_loop(4, 4, 4, 0.1), 4)
    assert m.method == "span" and m.rollouts_per_s == pytest.approx(40, rel=0.01)


@pytest.mark.alone  # measures rates
async def test_real_simulator_short_step(tmp_path) -> None:
    sim = spawn_simulator("--slots", "16", "--latency-ms", "40")
    try:
        s = setup_run(tmp_path, sim.url, rows=400)
        feed = ProbeFeed(s.ctx, s.plan)
        below = await probe_step(s.ctx, feed.take(120), 8, chunks=s.plan.scan.chunks)
        above = await probe_step(s.ctx, feed.take(160), 32, chunks=s.plan.scan.chunks)
        feed.close()
        await close_loop_session()
    finally:
        sim.stop()
    capacity = 16 / 0.04
    # Below the knee a step runs at parallelism / latency, and the latency is this host's: a 40-ms reply
    # took 42.5 to 54 ms over loopback here from hour to hour, which the nominal 40 ms left out.
    latency_s = below.measure.p50_s
    assert latency_s is not None and 0.04 <= latency_s < 0.08, latency_s
    assert 0.8 * 8 / latency_s <= below.rollouts_per_s <= 1.05 * 8 / latency_s, (below.measure, latency_s)
    assert 0.8 * capacity <= above.rollouts_per_s <= 1.1 * capacity
    assert below.saved == 120 and above.saved == 160


@pytest.mark.alone  # measures rates
async def test_steps_above_the_knee_never_read_above_capacity(tmp_path) -> None:
    """A 32-slot, 50 ms backend serves at most 640/s: no step at or past its knee may measure more."""
    sim = spawn_simulator("--slots", "32", "--latency-ms", "50")
    capacity = 32 / 0.05
    steps = []
    try:
        s = setup_run(tmp_path, sim.url, rows=4000)
        feed = ProbeFeed(s.ctx, s.plan)
        for parallelism in (40, 64, 80, 128, 64, 80):
            items = feed.take(step_rollouts(parallelism, TuneOptions()))
            steps.append(await probe_step(s.ctx, items, parallelism, chunks=s.plan.scan.chunks))
        feed.close()
        await close_loop_session()
    finally:
        sim.stop()
    for st in steps:
        m = st.measure
        assert m.method == "progress" and 0 < m.rate_err < 0.1 * m.rollouts_per_s, st.as_dict()
        assert m.rollouts_per_s - 2 * m.reported_err <= capacity, st.as_dict()
