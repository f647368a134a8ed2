"""tune-parallelism: the search and choice on synthetic curves, the knee on real simulators, no waste."""

from __future__ import annotations

from typing import Any

import pytest
from tuning_support import assert_nothing_wasted, closed_loop, setup_run

from rollflow.infra.local import spawn_simulator
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.publish.plot import evidence_said
from rollflow.tasks.tuning.adaptive import AdaptiveOptions, AdaptiveState, Sample, decide
from rollflow.tasks.tuning.diagnose import diagnose
from rollflow.tasks.tuning.probe import ProbeFeed, StepResult
from rollflow.tasks.tuning.throughput import StepMeasure, measure_step
from rollflow.tasks.tuning.tune import (
    TuneOptions,
    TuneStep,
    Tuning,
    choose,
    knee_estimate,
    refine_target,
    search_stop,
    step_rollouts,
    tune,
)
from rollflow.tasks.tuning.tune_rules import choice_rule, to_extend


def step(p: int, slots: int, latency: float = 0.05, n: int | None = None) -> StepResult:
    n = n or step_rollouts(p, TuneOptions())
    return StepResult(f"p{p}", p, measure_step(closed_loop(n, p, slots, latency), p))


def curve_step(p: int, rate: float, rel_err: float = 0.01) -> StepResult:
    """A step read off a curve: `rate` rollouts/s at `p` in flight, Little's law for its latency."""
    m = StepMeasure(p, 300, 300, rate, p / rate, 1.5 * p / rate, rate_err=rel_err * rate)
    return StepResult(f"p{p}", p, m)


def test_search_goes_on_while_throughput_grows_and_chooses_at_a_sharp_knee() -> None:
    opts = TuneOptions()
    s5, s20, s40, s80 = step(5, 32), step(20, 32), step(40, 32), step(80, 32)
    assert search_stop([s5], s20, s5, opts) is None
    # 40 in flight on 32 slots: latency grew by a quarter, throughput by 60%: no reason to stop
    assert search_stop([s5, s20], s40, s5, opts) is None
    assert search_stop([s5, s20, s40], s80, s5, opts) == "plateau"
    steps = [s5, s20, s40, s80]
    knee = knee_estimate(steps)
    assert 32 <= knee <= 34  # Little's law on a 100-rollout step overshoots a deterministic queue a little
    assert refine_target(steps, knee, opts) == knee
    s_knee = step(knee, 32)
    assert refine_target([*steps, s_knee], knee, opts) is None  # nothing under the knee can reach the peak
    assert choose([*steps, s_knee], opts) == knee
    assert choice_rule([*steps, s_knee], knee, opts).startswith("smallest")


def gradual(p: int) -> float:
    """A continuous-batching engine's curve: half its compute limit at 12 in flight."""
    return 60.0 * p / (p + 12)


def test_a_gradual_curve_is_searched_past_the_latency_growth_and_chosen_near_its_best() -> None:
    """The old rules stopped this curve at 40 ('latency-knee') and chose about 0.7 of its best."""
    opts = TuneOptions()
    steps = [curve_step(p, gradual(p)) for p in (5, 20)]
    for p in (40, 80, 160):
        assert search_stop(steps, curve_step(p, gradual(p)), steps[0], opts) is None, p
        steps.append(curve_step(p, gradual(p)))
    assert search_stop(steps, curve_step(320, gradual(320)), steps[0], opts) == "plateau"
    steps.append(curve_step(320, gradual(320)))
    knee = knee_estimate(steps)
    assert choose(steps, opts) == 320
    target = refine_target(steps, knee, opts)
    assert target == 240  # between the choice and the level below it, not the bandwidth-delay knee
    steps.append(curve_step(target, gradual(target)))
    assert choose(steps, opts) == 240
    assert refine_target(steps, knee, opts) == 200
    steps.append(curve_step(200, gradual(200)))
    chosen = choose(steps, opts)
    assert chosen == 200 and gradual(chosen) >= opts.target_share * gradual(320)
    assert "0.97" in choice_rule(steps, chosen, opts)


def test_a_noisy_level_below_the_choice_is_measured_again_before_choosing() -> None:
    opts = TuneOptions()
    steps = [curve_step(40, 46.0, 0.06), curve_step(80, 52.0), curve_step(160, 53.0)]
    assert choose(steps, opts) == 80
    assert to_extend(steps, opts) is steps[0]  # 46 + 2 x 2.8 could reach 0.97 x 53
    steps[0] = curve_step(40, 46.0, 0.01)
    assert to_extend(steps, opts) is None
    # within the uncertainty of the best but short of the target share: the choice itself is re-measured
    steps = [curve_step(40, 50.0, 0.03), curve_step(80, 53.0)]
    assert choose(steps, opts) == 40 and to_extend(steps, opts) is steps[0]


def test_adaptive_decisions() -> None:
    opts = AdaptiveOptions()
    st = AdaptiveState(limit=8)
    assert decide(st, Sample(1.0, 80, {}, 0.1), opts) == (16, "probing upward")
    assert decide(st, Sample(1.0, 120, {}, 0.1), opts)[1] == "settling"
    assert decide(st, Sample(1.0, 160, {}, 0.1), opts)[0] == 32  # grew: keep doubling
    decide(st, Sample(1.0, 250, {}, 0.1), opts)
    assert decide(st, Sample(1.0, 300, {}, 0.1), opts)[0] == 64
    decide(st, Sample(1.0, 300, {}, 0.2), opts)
    new, why = decide(st, Sample(1.0, 305, {}, 0.2), opts)  # 64 bought nothing: settle just above 32
    assert why.startswith("plateau") and new == 36
    decide(st, Sample(1.0, 300, {}, 0.11), opts)
    new, why = decide(st, Sample(1.0, 300, {"http_429": 3}, 0.11), opts)
    assert why.startswith("errors") and new == 27


PROFILES = [
    # slots, latency ms, extra simulator args, acceptable chosen range
    (8, 50, (), (7, 15)),
    (32, 50, (), (29, 60)),
    # 128 slots: test_tune_band.py's 128 x 200 ms profile (five runs; the last is checked for waste as here)
    # with 3% faults a step's rate carries the faults' noise: the band is up to 2x the slots
    (32, 50, ("--fault-rate", "0.03", "--fault-kinds", "500,503,reset"), (29, 64)),
]


@pytest.mark.alone  # times the engine, the controller or the checks
@pytest.mark.parametrize(("slots", "latency_ms", "extra", "expected"), PROFILES, ids=lambda v: str(v))
async def test_knee_on_simulators_and_nothing_wasted(tmp_path, slots, latency_ms, extra, expected) -> None:
    sim = spawn_simulator("--slots", str(slots), "--latency-ms", str(latency_ms), *extra)
    try:
        # enough input for a whole search, its confirmations and the stability check at any knee
        n_rows = max(3000, 40 * slots)
        s = setup_run(tmp_path, sim.url, rows=n_rows, backoff_base_s=0.01, backoff_max_s=0.05)
        feed = ProbeFeed(s.ctx, s.plan)
        d = await diagnose(s.ctx, s.plan, feed=feed)
        t = await tune(s.ctx, s.plan, TuneOptions(), feed=feed, seeds=[d.low, d.high])
        feed.close()
        lo, hi = expected
        assert lo <= t.chosen_parallelism <= hi, t.as_dict()
        assert t.stable
        # collection adopts every saved probe rollout and asks the backend only for the rest
        await assert_nothing_wasted(s, d, t, sim.url, n_rows, exact_requests=not extra)
    finally:
        sim.stop()


@pytest.mark.alone  # times the engine, the controller or the checks
@pytest.mark.parametrize("processes", [0, 1])
async def test_a_verification_limit_is_not_taken_for_the_backends(tmp_path, processes: int) -> None:
    """A zero-latency backend with 2 ms checks in one thread, or in one verifier process: the curve
    flattens because of verification; tuning says so (limited_by, a note naming --verify-processes)
    instead of reporting a backend knee."""
    sim = spawn_simulator("--slots", "256", "--latency-ms", "0")
    try:
        s = setup_run(
            tmp_path, sim.url, rows=4000, kind="responses",
            verifier="busy_verifier:score", verify_processes=processes,
        )  # fmt: skip
        t = await tune(s.ctx, s.plan, TuneOptions())
        await close_loop_session()
    finally:
        sim.stop()
    assert t.limited_by == "verification", t.as_dict()
    figures = t.verification
    assert figures["verify_processes"] == processes, figures
    assert figures["verify_capacity_per_s"] > 0, figures
    assert any("--verify-processes" in note for note in t.notes), t.notes


@pytest.mark.alone  # times the engine, the controller or the checks
async def test_a_search_cut_by_its_step_budget_still_checks_its_choice(tmp_path) -> None:
    """The step budget bounds the search; the choice still runs its stability stretch (it was skipped, and
    a tuning that had spent its steps on extensions reported itself unstable)."""
    sim = spawn_simulator("--slots", "32", "--latency-ms", "20")
    try:
        s = setup_run(tmp_path, sim.url, rows=3000, backoff_base_s=0.01, backoff_max_s=0.05)
        feed = ProbeFeed(s.ctx, s.plan)
        d = await diagnose(s.ctx, s.plan, feed=feed)
        t = await tune(s.ctx, s.plan, TuneOptions(max_steps=1), feed=feed, seeds=[d.low, d.high])
        feed.close()
        phases = [x.phase for x in t.steps]
        assert phases.count("search") == 1 and t.stop_reason == "step or time budget", t.as_dict()
        stretch = t.steps[-1]
        assert stretch.phase == "stability" and stretch.parallelism == t.chosen_parallelism, t.as_dict()
        assert t.stable and not t.notes, t.as_dict()
    finally:
        sim.stop()


def test_errors_that_do_not_grow_with_load_do_not_cut_the_limit() -> None:
    """10% random faults at every limit of a backend whose rate grows with the limit: one cut before any
    other limit was read, then the controller grows through them; errors that rise with the limit cut."""
    opts = AdaptiveOptions()
    st = AdaptiveState(limit=30, slow_start=False)

    def at(limit: int, fault_share: float = 0.1) -> Sample:
        ok = 3 * limit
        return Sample(1.0, ok, {"http_500": round(ok * fault_share / (1 - fault_share))}, 0.1)

    new, why = decide(st, at(30), opts)
    assert why.startswith("errors") and new == 22  # nothing read at another limit yet
    limits = [decide(st, at(st.limit), opts)[0] for _ in range(12)]
    assert max(limits) > 30, limits  # the same 10% at 22 as at 30: it grows through them
    assert decide(st, at(st.limit, 0.3), opts)[1].startswith("errors")  # 30% here against 10% elsewhere


def test_the_choice_is_squared_with_the_verdict() -> None:
    """A ceiling the diagnosis found (429s, errors with load) caps the tuned choice; a choice far above a
    level it advised stands with the rates that justify it, said in a note."""
    from rollflow.tasks.tuning.diagnose import reconcile

    def diagnosis(verdict: str, advised: int, ceiling: bool) -> dict[str, Any]:
        return {"verdict": verdict, "advised_parallelism": advised, "advised_is_ceiling": ceiling}

    chosen, note = reconcile(diagnosis("rate-limited", 5, True), 40, {5: 90.0, 40: 95.0})
    assert chosen == 5 and note is not None and note.startswith("capped at 5") and "40" in note
    chosen, note = reconcile(diagnosis("backend-bound", 5, False), 60, {5: 50.0, 10: 52.0, 60: 99.6})
    assert chosen == 60 and note is not None and "99.6/s there against 52.0/s at 10" in note
    assert reconcile(diagnosis("backend-bound", 5, False), 8, {8: 60.0}) == (8, None)  # near enough
    assert reconcile(diagnosis("rate-limited", 20, True), 16, {16: 60.0}) == (16, None)  # below it
    reused = {
        **diagnosis("over-capacity", 5, True),
        "reused": "the diagnosis in diagnosis.json, made 60 s earlier",
    }
    chosen, note = reconcile(reused, 32, {5: 140.0, 32: 835.0}, clean_above=True)  # the backend grew since
    assert chosen == 32 and note is not None and note.startswith("not capped at 5"), note
    assert reconcile(reused, 32, {5: 140.0}, clean_above=False)[0] == 5  # errors above it still: capped
    assert reconcile(diagnosis("over-capacity", 5, True), 32, {32: 835.0}, clean_above=True)[0] == 5  # fresh


def _step(parallelism: int, rate: float, err: float, errors: int = 0) -> TuneStep:
    return TuneStep("search", parallelism, rate, 0.1, 0.2, errors, 100, rollouts_per_s_err=err)


def test_the_choice_states_its_readings_and_their_spread() -> None:
    """A choice is never shown surer than its readings: their count, mean, range and error; one reading
    says so; a level set by a rule between measured ones says it was not measured."""
    steps = [_step(16, 50.0, 2.0), _step(32, 96.0, 3.0), _step(64, 90.0, 4.0), _step(32, 104.0, 5.0)]
    tuning = Tuning(steps, knee=32, chosen_parallelism=32, probe_rollouts=400, stop_reason="x",
                    peak_rollouts_per_s=104.0, base_latency_s=0.1)  # fmt: skip
    ev = {"readings": 2, "rollouts_per_s": 100.0, "low": 96.0, "high": 104.0, "err": 5.0, "agree": True}
    assert tuning.evidence() == ev
    said = evidence_said(tuning.as_dict())
    assert said == "100.0 ± 5.0 rollouts/s over 2 readings from 96.0 to 104.0", said
    steps[3] = _step(32, 40.8, 3.9)  # a second reading far below the first: the rate moved meanwhile
    assert tuning.evidence()["agree"] is False
    assert "disagree beyond their errors" in evidence_said(tuning.as_dict())
    steps[3] = _step(32, 104.0, 5.0)
    tuning.chosen_parallelism = 64
    assert "from one reading" in evidence_said(tuning.as_dict())
    tuning.chosen_parallelism = 51  # x0.8 headroom after errors at 64: never measured itself
    assert tuning.evidence() == {"readings": 0, "nearest_below": 32}
    assert "not measured at its level" in evidence_said(tuning.as_dict())
    steps.append(_step(51, 80.0, 1.0, errors=3))  # a reading with errors is no evidence for the level
    assert tuning.evidence()["readings"] == 0
