"""Tuning: rollflow's diagnose+tune beside the NeMo Gym hand recipe, and adaptive mode on a changing backend.

For each simulator profile (N slots x latency L, capacity N/L rollouts/s):
- recipe: 100 rows at 5 and at 20; doubling from 5 on 200 rows a step (rate = rows / wall time) until the
  gain is under 10%; 80% of the peak's parallelism; 1000-row validation at that value;
- rollflow: diagnose (100 at 5 and 20) + tune (steady-rate steps, BDP knee, refinement, stability).
Both choices are then measured on a 1500-rollout run (not counted as tuning) as a fraction of capacity.
Goal: rollflow >= 0.90 of capacity with at most half the recipe's probe rollouts, none discarded.
Then diagnose+tune runs REPEATS times in all on fresh rows: the spread (min/median/max) of its choice.

Engine metrics: the same profiles with the simulator's vLLM /metrics on and off (`--metrics-format none`):
diagnose+tune's probe rollouts and its choice's share of capacity (1500-rollout run), median of ENGINE_RUNS.
Goal: at most half the probe rollouts at the same share. The recipe rows above run without /metrics.

Batching engines: the simulator's continuous-batching profiles (`--profile batching|kv-limited|preempting`:
each decode step slows as the batch grows, so throughput rises gradually to a compute limit, flattens at
a KV-cache limit, or falls past a point). The best of a fixed-parallelism sweep is the reference; the
recipe's and rollflow's choices are measured as a share of it. Goal: rollflow >= 0.90 of the best.

Adaptive: a simulator whose slots change mid-run (POST /admin/config); adaptive mode's steady rate in each
phase against the best of several fixed settings in that phase. Goal: within 15%.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import orjson
from harness import spawn_simulator, write_input

from rollflow.settings import RollflowSettings, RunSpec
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.collect.plan import plan_run
from rollflow.tasks.collect.rollouts import RolloutBatch, run_rollouts
from rollflow.tasks.collect.runtime import collect_context, open_run
from rollflow.tasks.tuning.adaptive import AdaptiveOptions, adaptive_control
from rollflow.tasks.tuning.diagnose import diagnose
from rollflow.tasks.tuning.probe import ProbeFeed, probe_step
from rollflow.tasks.tuning.tune import TuneOptions, tune

PROFILES = [(8, 50.0), (32, 50.0), (48, 100.0), (128, 400.0)]
ENGINE_PROFILES = ["batching", "kv-limited", "preempting"]
SWEEP = (16, 32, 48, 64, 96, 128, 192, 256)
REPEATS = 10
ENGINE_RUNS = 3


def _context(url: str, work: Path, rows: int, backend: dict | None = None):  # type: ignore[no-untyped-def]
    """`backend`: another kind than the simulator's agent (`{"kind": "chat", "model": ...}` for vLLM, with
    `max_output_tokens` for the rows, which is not a backend setting)."""
    backend = dict(backend or {})
    inp = write_input(work / "input.jsonl", rows, max_output_tokens=backend.pop("max_output_tokens", None))
    spec = RunSpec(
        input=str(inp),
        output=str(work / "out"),
        backend={"kind": "agent", "url": url, **(backend or {})},
        collection={"chunk_size": 1000},
    )
    settings = RollflowSettings()
    handles = open_run(spec, settings)
    plan = plan_run(spec, handles.store, handles.ledger, handles.input_options, None)
    return collect_context(handles, settings, 1), plan


async def recipe(ctx, plan, feed) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """The hand recipe; returns (rollouts spent, chosen parallelism)."""
    spent = 0

    async def naive(p: int, n: int) -> float:
        nonlocal spent
        items = await feed.next(n)
        t0 = time.perf_counter()
        await probe_step(ctx, items, p, chunks=plan.scan.chunks, label=f"recipe-p{p}")
        spent += len(items)
        return len(items) / (time.perf_counter() - t0)

    await naive(5, 100)
    await naive(20, 100)
    best_p, best_rate, p, prev = 5, 0.0, 5, 0.0
    while p <= 4096:
        rate = await naive(p, 200)
        if rate > best_rate:
            best_p, best_rate = p, rate
        if prev and rate < prev * 1.10:
            break
        prev, p = rate, p * 2
    chosen = max(1, round(0.8 * best_p))
    await naive(chosen, 1000)
    return spent, chosen


async def measure(ctx, plan, feed, p: int, n: int = 1500) -> float:  # type: ignore[no-untyped-def]
    step = await probe_step(ctx, await feed.next(n), p, chunks=plan.scan.chunks, label=f"measure-p{p}")
    return step.rollouts_per_s


async def diagnose_and_tune(ctx, plan, feed):  # type: ignore[no-untyped-def]
    d = await diagnose(ctx, plan, feed=feed)
    return d, await tune(ctx, plan, TuneOptions(), feed=feed, seeds=[d.low, d.high])


async def compare(slots: int, latency_ms: float) -> None:
    capacity = slots * 1000 / latency_ms
    sim = spawn_simulator("--slots", str(slots), "--latency-ms", str(latency_ms), "--metrics-format", "none")
    try:
        work = Path(tempfile.mkdtemp(prefix="rollflow-bench-tune-"))
        ctx, plan = _context(sim.url, work, 60_000)
        feed = ProbeFeed(ctx, plan)
        r_spent, r_chosen = await recipe(ctx, plan, feed)
        d, t = await diagnose_and_tune(ctx, plan, feed)
        f_spent = d.probe_rollouts + t.probe_rollouts
        r_rate = await measure(ctx, plan, feed, r_chosen)
        f_rate = await measure(ctx, plan, feed, t.chosen_parallelism)
        choices = [t.chosen_parallelism]
        for _ in range(REPEATS - 1):
            choices.append((await diagnose_and_tune(ctx, plan, feed))[1].chosen_parallelism)
        feed.close()
        await close_loop_session()
    finally:
        sim.stop()
    print(
        f"  {slots:>5} x {latency_ms:>4.0f} ms  {capacity:>8,.0f}/s | recipe {r_spent:>5,} rollouts, chose "
        f"{r_chosen:>4}, {r_rate / capacity:>5.2f} of capacity | rollflow {f_spent:>5,} rollouts "
        f"({f_spent / r_spent:.2f} of recipe), knee {t.knee:>4}, chose {t.chosen_parallelism:>4}, "
        f"{f_rate / capacity:>5.2f} of capacity, {d.verdict}, "
        f"discarded {sum(s.errors for s in t.steps)} (failed probes: never saved as parts)"
    )
    print(
        f"  {'':>19}choice over {len(choices)} runs: min {min(choices)}, median "
        f"{statistics.median(choices):g}, max {max(choices)} ({min(choices) / slots:.2f}x to "
        f"{max(choices) / slots:.2f}x the slots)"
    )


async def engine_side(slots: int, latency_ms: float, fmt: str) -> tuple[int, float, int]:
    """Median probe rollouts, share of capacity and choice of diagnose+tune with /metrics as `fmt`."""
    capacity = slots * 1000 / latency_ms
    sim = spawn_simulator("--slots", str(slots), "--latency-ms", str(latency_ms), "--metrics-format", fmt)
    spent, shares, choices = [], [], []
    try:
        for _ in range(ENGINE_RUNS):
            work = Path(tempfile.mkdtemp(prefix="rollflow-bench-engine-"))
            ctx, plan = _context(sim.url, work, 12_000)
            feed = ProbeFeed(ctx, plan)
            d, t = await diagnose_and_tune(ctx, plan, feed)
            spent.append(d.probe_rollouts + t.probe_rollouts)
            choices.append(t.chosen_parallelism)
            shares.append(await measure(ctx, plan, feed, t.chosen_parallelism) / capacity)
            feed.close()
            await close_loop_session()
    finally:
        sim.stop()
    return round(statistics.median(spent)), statistics.median(shares), round(statistics.median(choices))


async def engine_rows(slots: int, latency_ms: float) -> None:
    off = await engine_side(slots, latency_ms, "none")
    on = await engine_side(slots, latency_ms, "vllm")
    print(
        f"  {slots:>5} x {latency_ms:>4.0f} ms | without /metrics {off[0]:>5,} probe rollouts, "
        f"chose {off[2]:>4}, {off[1]:.2f} of capacity | with {on[0]:>5,} ({on[0] / off[0]:.2f} of them), "
        f"chose {on[2]:>4}, {on[1]:.2f} of capacity"
    )


async def batching_row(profile: str) -> None:
    """The recipe and rollflow on a continuous-batching profile, against its best fixed parallelism."""
    sim = spawn_simulator("--profile", profile, "--metrics-format", "none")
    try:
        work = Path(tempfile.mkdtemp(prefix="rollflow-bench-batching-"))
        ctx, plan = _context(sim.url, work, 60_000)
        feed = ProbeFeed(ctx, plan)
        curve = {p: await measure(ctx, plan, feed, p, n=max(1000, 4 * p)) for p in SWEEP}
        best = max(curve, key=lambda p: curve[p])
        r_spent, r_chosen = await recipe(ctx, plan, feed)
        d, t = await diagnose_and_tune(ctx, plan, feed)
        shares = []
        for chosen in (r_chosen, t.chosen_parallelism):
            rate = await measure(ctx, plan, feed, chosen)
            shares.append(rate / await measure(ctx, plan, feed, best))
        feed.close()
        await close_loop_session()
    finally:
        sim.stop()
    f_spent = d.probe_rollouts + t.probe_rollouts
    print(
        f"  {profile:<10} best fixed {best:>4} ({curve[best]:>5,.0f}/s) | recipe {r_spent:>5,} rollouts, "
        f"chose {r_chosen:>4}, {shares[0]:>5.2f} of best | rollflow {f_spent:>5,} rollouts, chose "
        f"{t.chosen_parallelism:>4} ({t.stop_reason}; {t.choice_rule}), {shares[1]:>5.2f} of best"
    )


def _admin(url: str, changes: dict[str, object]) -> None:
    req = urllib.request.Request(f"{url}/admin/config", data=orjson.dumps(changes), method="POST")
    urllib.request.urlopen(req, timeout=10).close()


def _phase_rate(records, t0: float, t1: float) -> float:  # type: ignore[no-untyped-def]
    done = sum(1 for r in records if r.error is None and t0 <= r.end < t1)
    return done / (t1 - t0)


async def adaptive(phase_s: float, phases: list[int], latency_ms: float) -> None:
    """Adaptive mode against the best fixed setting, per phase of a simulator whose slots change."""
    fixed_levels = sorted({max(1, int(s * f)) for s in phases for f in (0.5, 1.0, 1.5, 2.0)})
    sim = spawn_simulator("--slots", str(phases[0]), "--latency-ms", str(latency_ms))
    try:
        work = Path(tempfile.mkdtemp(prefix="rollflow-bench-adaptive-"))
        peak = max(phases) * 1000 / latency_ms
        ctx, plan = _context(sim.url, work, math.ceil(peak * phase_s * len(phases) * 2.5))
        feed = ProbeFeed(ctx, plan)
        best: list[float] = []
        for slots in phases:
            _admin(sim.url, {"slots": slots})
            rates = [await measure(ctx, plan, feed, p, n=max(300, 4 * p)) for p in fixed_levels]
            best.append(max(rates))
        _admin(sim.url, {"slots": phases[0]})
        ctx.limit.set_limit(8)
        batch = RolloutBatch()
        items = await feed.next(math.ceil(peak * phase_s * len(phases) * 1.5))
        switches: list[float] = []

        async def switcher() -> None:
            for slots in phases[1:]:
                await asyncio.sleep(phase_s)
                switches.append(time.perf_counter())
                await asyncio.to_thread(_admin, sim.url, {"slots": slots})

        t_start = time.perf_counter()
        async with adaptive_control(ctx, AdaptiveOptions(interval_s=1.0)) as controller:
            runner = asyncio.create_task(run_rollouts(ctx, items, batch))
            await switcher()
            await asyncio.sleep(phase_s)
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        t_end = time.perf_counter()
        feed.close()
        await close_loop_session()
    finally:
        sim.stop()
    bounds = [t_start, *switches, t_end]
    settle = 3.0
    for i, slots in enumerate(phases):
        rate = _phase_rate(batch.records, bounds[i] + settle, bounds[i + 1])
        limits = [h["limit"] for h in controller.history if bounds[i] <= t_start + h["t_s"] < bounds[i + 1]]
        print(
            f"  phase {i + 1}: {slots:>3} slots x {latency_ms:.0f} ms | adaptive {rate:>7,.1f}/s "
            f"(limit {limits[0] if limits else '-'} -> {limits[-1] if limits else '-'}) | best fixed "
            f"{best[i]:>7,.1f}/s | {rate / best[i]:.2f} of best"
        )


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--phase-s", type=float, default=15.0)
    ap.add_argument("--skip-adaptive", action="store_true")
    ap.add_argument("--only-engine", action="store_true", help="only the engine-metrics rows")
    ap.add_argument("--only-batching", action="store_true", help="only the batching-engine rows")
    args = ap.parse_args()
    if not (args.only_engine or args.only_batching):
        print("tune-parallelism: recipe vs rollflow (probe rollouts; choice measured on 1500 rollouts)")
        for slots, latency in PROFILES:
            await compare(slots, latency)
        print("  goal: rollflow >= 0.90 of capacity with <= 0.5 of the recipe's rollouts, none discarded")
    print("batching engines: recipe vs rollflow against the best of a fixed sweep (1500-rollout pairs)")
    for profile in ENGINE_PROFILES:
        await batching_row(profile)
    print("  goal: rollflow >= 0.90 of the best fixed parallelism")
    if args.only_batching:
        return
    print(f"engine metrics: diagnose+tune with and without /metrics (median of {ENGINE_RUNS} runs each)")
    for slots, latency in PROFILES:
        await engine_rows(slots, latency)
    print("  goal: with /metrics at most 0.5 of the probe rollouts at the same share of capacity")
    if args.only_engine:
        return
    if not args.skip_adaptive:
        print("adaptive parallelism: slots change mid-run (16 -> 48 -> 24), 100 ms")
        await adaptive(args.phase_s, [16, 48, 24], 100.0)
        print("  goal: each phase within 15% of the best fixed setting (>= 0.85)")


if __name__ == "__main__":
    asyncio.run(main())
