"""The tuner's choice lands in the knee's band every time, not on average: five runs per simulator profile."""

from __future__ import annotations

import pytest
from tuning_support import assert_nothing_wasted, setup_run

from rollflow.infra.local import spawn_simulator
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.tuning.diagnose import diagnose
from rollflow.tasks.tuning.probe import ProbeFeed
from rollflow.tasks.tuning.tune import TuneOptions, tune

RUNS = 5
# slots, latency ms, lowest acceptable choice as a share of the slots, whether the last run's input is then
# collected (test_tune.py's check that no probe rollout is wasted); jitter 20% on all. The 128-slot profile
# also stands for test_tune.py's former 128 x 400 ms one: its floor (115 = 0.9 x 128) and that check.
PROFILES = [(8, 50, 0.75, False), (32, 50, 0.75, False), (128, 200, 0.9, True)]


@pytest.mark.parametrize(("slots", "latency_ms", "floor", "collect"), PROFILES, ids=lambda v: str(v))
async def test_every_choice_within_the_knee_band(
    tmp_path, slots: int, latency_ms: int, floor: float, collect: bool
) -> None:
    sim = spawn_simulator("--slots", str(slots), "--latency-ms", str(latency_ms), "--jitter", "0.2")
    choices: list[int] = []
    # enough input for a whole search, its confirmations and the stability check at any knee
    n_rows = max(3000, 40 * slots)
    try:
        for run in range(RUNS):
            (work := tmp_path / f"run{run}").mkdir()
            s = setup_run(work, sim.url, rows=n_rows, backoff_base_s=0.01, backoff_max_s=0.05)
            feed = ProbeFeed(s.ctx, s.plan)
            d = await diagnose(s.ctx, s.plan, feed=feed)
            t = await tune(s.ctx, s.plan, TuneOptions(), feed=feed, seeds=[d.low, d.high])
            feed.close()
            await close_loop_session()
            choices.append(t.chosen_parallelism)
            assert floor * slots <= t.chosen_parallelism <= 1.5 * slots and t.stable, (
                choices,
                t.stable,
                t.stop_reason,
                [
                    (x.phase, x.parallelism, round(x.rollouts_per_s), round(x.rollouts_per_s_err), x.rollouts)
                    for x in t.steps
                ],
            )
        if collect:
            await assert_nothing_wasted(s, d, t, sim.url, n_rows)
    finally:
        sim.stop()
    assert len(choices) == RUNS
