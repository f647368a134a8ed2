"""diagnose-bottleneck: verdicts on synthetic steps, and against simulators whose limits are known."""

from __future__ import annotations

import pytest
from tuning_support import closed_loop, setup_run

from rollflow.infra.local import spawn_simulator
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.collect.parts import chunk_part_rollouts
from rollflow.tasks.tuning.diagnose import diagnose, verdict
from rollflow.tasks.tuning.probe import ProbeFeed, StepResult, VerifyUsage, probe_step
from rollflow.tasks.tuning.throughput import measure_step
from rollflow.tasks.verify.pool import close_pools


def step(p: int, slots: int, latency: float = 0.05, **kw) -> StepResult:
    return StepResult(f"p{p}", p, measure_step(closed_loop(100, p, slots, latency), p), **kw)


def test_verdicts_from_synthetic_steps() -> None:
    assert verdict(step(5, 64), step(20, 64)).verdict == "parallelism-bound"
    assert verdict(step(5, 8), step(20, 8)).verdict == "partly-parallelism-bound"
    backend = verdict(step(5, 4, backend_s=5.0, verify_s=0.1), step(20, 4, backend_s=20.0, verify_s=0.1))
    assert backend.verdict == "backend-bound" and "replicas" in backend.next_step
    verifier = verdict(step(5, 4, backend_s=2.0, verify_s=3.0), step(20, 4, backend_s=2.0, verify_s=18.0))
    assert verifier.verdict == "verifier-bound"
    limited = verdict(step(5, 64), step(20, 64, attempt_errors={"http_429": 12}))
    assert limited.verdict == "rate-limited" and "429" in limited.reason
    flaky = verdict(step(5, 64, attempt_errors={"http_500": 3}), step(20, 64, attempt_errors={"http_500": 3}))
    assert flaky.verdict == "parallelism-bound"  # steady faults at any load are not over capacity
    over = verdict(step(5, 64), step(20, 64, attempt_errors={"http_503": 30, "timeout": 4}))
    assert over.verdict == "over-capacity" and "timeout" in over.reason
    d = verdict(step(5, 64), step(20, 64)).as_dict()
    assert set(d) >= {"verdict", "throughput", "errors", "time_split", "next_step"}
    assert "discarded" not in d, "only a run that collected can count what its chunks adopted"


def test_checks_at_their_capacity_are_the_limit_whatever_a_short_steps_ratio_says() -> None:
    """Two short steps of a thread-bound verifier can read x1.2-1.3 apart on a busy machine; the high
    step running at what its checks sustain (by their CPU) is the verdict, not the noisy ratio."""
    low = step(5, 64, backend_s=0.2, verify_s=0.8, usage=VerifyUsage(0.75, 0.8, 100, 0.8, 1.0))
    fast = closed_loop(100, 20, 64, 0.05 * 4 / 1.3)  # x1.3 the low step's rate
    high = StepResult("p20", 20, measure_step(fast, 20), backend_s=0.2, verify_s=0.8)
    rate = high.rollouts_per_s
    high.usage = VerifyUsage(0.9 * 100 / rate, 100 / rate, 100, 100 / rate, 100 / rate)
    d = verdict(low, high, verify_processes=0)
    assert 1.2 <= d.speedup < 2.0, d.speedup
    assert d.verdict == "verifier-bound" and "--verify-processes" in d.next_step, (d.verdict, d.reason)
    assert "Keep parallelism near 20" in d.next_step, d.next_step
    idle = StepResult("p20", 20, measure_step(fast, 20), usage=VerifyUsage(0.1, 0.1, 100, 100 / rate, 1.0))
    assert verdict(low, idle, verify_processes=0).verdict == "partly-parallelism-bound"


CASES = [
    (("--slots", "64", "--latency-ms", "40"), {}, "agent", "parallelism-bound"),
    (("--slots", "8", "--latency-ms", "40"), {}, "agent", "partly-parallelism-bound"),
    (("--slots", "4", "--latency-ms", "40"), {}, "agent", "backend-bound"),
    (
        ("--slots", "64", "--latency-ms", "20"),
        {"verifier": "slow_verifier:verify"},
        "responses",
        "verifier-bound",
    ),
    (
        (
            "--slots",
            "64",
            "--latency-ms",
            "40",
            "--fault-rate",
            "0.1",
            "--fault-kinds",
            "429",
            "--retry-after-s",
            "0.02",
        ),
        {},
        "agent",
        "rate-limited",
    ),
    (
        ("--slots", "6", "--latency-ms", "40", "--max-queue", "2"),
        {"max_retries": 1, "backoff_base_s": 0.01, "backoff_max_s": 0.02},
        "agent",
        "over-capacity",
    ),
]


@pytest.mark.alone  # times the engine, the controller or the checks
@pytest.mark.parametrize(("sim_args", "extra", "kind", "expected"), CASES, ids=[c[3] for c in CASES])
async def test_verdicts_against_the_simulator(tmp_path, sim_args, extra, kind, expected) -> None:
    sim = spawn_simulator(*sim_args)
    try:
        s = setup_run(tmp_path, sim.url, rows=400, kind=kind, chunk_size=100, **extra)
        d = await diagnose(s.ctx, s.plan, low=5, high=20, rows=100)
        await close_loop_session()
    finally:
        sim.stop()
    assert d.verdict == expected, (d.verdict, d.reason)
    saved = sum(
        len(chunk_part_rollouts(s.handles.ledger, c, s.plan.identity.num_repeats).kept)
        for c in s.plan.scan.chunks
    )
    assert saved == d.low.saved + d.high.saved == d.low.measure.ok + d.high.measure.ok


@pytest.mark.alone  # times the engine, the controller or the checks
async def test_a_cpu_bound_verifier_is_named_with_its_figures_and_the_processes_flag(tmp_path) -> None:
    """Checks in one thread of the collecting process cap a zero-latency backend: the verdict says so,
    with the verification time, its share and where it runs, and names --verify-processes."""
    sim = spawn_simulator("--slots", "64", "--latency-ms", "0")
    try:
        s = setup_run(
            tmp_path, sim.url, rows=400, kind="responses", chunk_size=100,
            verifier="busy_verifier:score_8ms", verify_processes=0,
        )  # fmt: skip
        feed = ProbeFeed(s.ctx, s.plan)
        # warm the path first (connections, the verifier's thread and import): the low level is measured
        # first, and a cold start read it up to a third low, as if more parallelism had paid
        await probe_step(s.ctx, await feed.next(40), 5, chunks=s.plan.scan.chunks, label="warm-up")
        d = await diagnose(s.ctx, s.plan, feed=feed, low=5, high=20, rows=100)
        feed.close()
        await close_loop_session()
    finally:
        sim.stop()
    assert d.verdict == "verifier-bound", (d.verdict, d.reason)
    assert "--verify-processes" in d.next_step, d.next_step
    assert "ms per rollout" in d.reason and "of each rollout's time" in d.reason, d.reason
    figures = d.as_dict()["verification"]
    assert figures["verify_processes"] == 0 and figures["verify_capacity_per_s"], figures
    assert "sustains" in d.reason, d.reason


@pytest.mark.alone  # times the engine, the controller or the checks
async def test_the_verifier_processes_start_is_not_counted_as_check_time(tmp_path) -> None:
    """A verifier whose import takes 3 s: the diagnosis waits for its processes before the first step and
    states that start apart, so the checks it times are checks (cheap here), not the import."""
    sim = spawn_simulator("--slots", "64", "--latency-ms", "5")
    try:
        s = setup_run(
            tmp_path, sim.url, rows=200, kind="responses", chunk_size=100,
            verifier="slow_import_verifier:score", verify_processes=2,
        )  # fmt: skip
        d = await diagnose(s.ctx, s.plan, low=5, high=20, rows=40)
        await close_loop_session()
    finally:
        sim.stop()
        close_pools()
    assert d.as_dict()["verifier_start_s"] >= 3.0, d.as_dict()
    verify_s = d.low.verify_s + d.high.verify_s  # 80 cheap checks; a cold start in them is 5 x 3 s or more
    assert verify_s < 3.0, (verify_s, d.reason)
    assert d.low.measure.ok == 40 and d.high.measure.ok == 40
