"""The tuner's choice lands in the knee's band every time, not on average: five runs per simulator profile."""

from __future__ import annotations

import pytest
from tuning_support import setup_run

from rollflow.infra.local import spawn_simulator
from rollflow.tasks.collect.http import close_loop_session
from rollflow.tasks.tuning.diagnose import diagnose
from rollflow.tasks.tuning.probe import ProbeFeed
from rollflow.tasks.tuning.tune import TuneOptions, tune

RUNS = 5
PROFILES = [(8, 50), (32, 50), (128, 200)]  # slots, latency ms; jitter 20% on all


@pytest.mark.parametrize(("slots", "latency_ms"), PROFILES, ids=lambda v: str(v))
async def test_every_choice_within_the_knee_band(tmp_path, slots: int, latency_ms: int) -> None:
    sim = spawn_simulator("--slots", str(slots), "--latency-ms", str(latency_ms), "--jitter", "0.2")
    choices: list[int] = []
    try:
        for run in range(RUNS):
            (work := tmp_path / f"run{run}").mkdir()
            s = setup_run(work, sim.url, rows=3000, backoff_base_s=0.01, backoff_max_s=0.05)
            feed = ProbeFeed(s.ctx, s.plan)
            d = await diagnose(s.ctx, s.plan, feed=feed)
            t = await tune(s.ctx, s.plan, TuneOptions(), feed=feed, seeds=[d.low, d.high])
            feed.close()
            await close_loop_session()
            choices.append(t.chosen_parallelism)
            assert 0.75 * slots <= t.chosen_parallelism <= 1.5 * slots, (
                choices,
                t.stop_reason,
                [
                    (x.phase, x.parallelism, round(x.rollouts_per_s), round(x.rollouts_per_s_err), x.rollouts)
                    for x in t.steps
                ],
            )
    finally:
        sim.stop()
    assert len(choices) == RUNS
