"""Concurrency controllers side by side in one run, on the simulator's paged KV cache (vLLM-like: a full
cache preempts the youngest request, which is recomputed) or on a real vLLM (`--vllm`, CPU, tiny model).

The reference is the best of a fixed-parallelism sweep. Then, in `--rounds` rounds (the order rotated each
round), that fixed value and each controller collect the same number of rollouts, the controllers from a
cold start; a controller is judged against the fixed value of its own round, since a machine's speed
drifts over minutes (on 2 cores beside vLLM, repeats of one fixed value varied 22-39/s), and the row gives
each round's figure beside the median. Tune-then-hold runs once, against the rounds' median. Methods:
- tune-then-hold: diagnose + tune (doubling from 5, steady-rate steps), then its choice held;
- adaptive (latency): the latency and 429 rules, on the same engine with its gauges hidden;
- engine: rollflow's engine-aware controller (`adaptive`, and `auto` on long runs);
- prime-rl rules: a controller written from prime-rl's published rules (start from KV capacity / the
  longest request, x1.25 per interval while KV use < 0.6, trim above 0.8, cut harder above 0.9 and on
  preemptions; rollflow cannot cancel work in flight, so "cancel the youngest" is a harder cut).
Figures per method: seconds to reach 0.95 of the best fixed rate (1 s buckets of completions), the share
of the run's seconds at or above it, the whole run's rate against the best, preemptions per 1,000
rollouts, and rollouts spent probing (tuning's probes; the controllers probe nothing apart).
Goal: >= 0.95 of the best fixed value over the whole run, in half the probing rollouts of tune-then-hold,
with no more preemptions than the best fixed value.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import statistics
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from harness import spawn_simulator
from results import RESULTS, save
from tuning import _context, diagnose_and_tune, measure

from rollflow.tasks.backends.engine_metrics import sample_endpoints
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.collect.rollouts import RolloutBatch, run_rollouts
from rollflow.tasks.tuning.adaptive import adaptive_control
from rollflow.tasks.tuning.engine_control import EngineOptions, EngineState, Reading, engine_control

SWEEP = (8, 16, 24, 32, 40, 48, 64, 96)
VLLM_SWEEP = (16, 32, 48, 64, 96)  # around its max_num_seqs (64): each level costs minutes on a CPU
VLLM_TOKENS = 96  # each reply's length: a randomly initialised model never ends one by itself
TARGET = 0.95


def prime_rl_rule(state: EngineState, r: Reading, opts: EngineOptions) -> tuple[int, str]:
    """prime-rl's published rules, as a rollflow rule (for comparison only)."""
    if r.samples == 0 or r.kv is None:
        return state.limit, "no signal"
    if r.preempted:
        state.limit = max(1, math.floor(state.limit * 0.5))
        return state.limit, "preempted: halve"
    if r.kv > 0.9:
        state.limit = max(1, math.floor(state.limit * 0.75))
        return state.limit, "KV > 0.9: cut (in place of cancelling the youngest)"
    if r.kv > 0.8:
        state.limit = max(1, math.floor(state.limit * 0.9))
        return state.limit, "KV > 0.8: trim"
    if r.kv < 0.6:
        state.limit = min(opts.max_limit, math.ceil(state.limit * 1.25))  # its own cap on concurrency
        return state.limit, "KV < 0.6: grow x1.25"
    return state.limit, "hold"


def _stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/stats", timeout=10) as resp:
        return json.loads(resp.read())


def _preemptions(url: str) -> int:
    """The engine's preemption counter: the simulator's /stats, or vLLM's /metrics."""
    try:
        return int(_stats(url)["preemptions"])
    except Exception:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        return round(
            sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:num_preemptions_total")
            )
        )


def _buckets(batch: RolloutBatch, t0: float, t1: float) -> list[int]:
    """Completed rollouts in each whole second from t0 to t1."""
    counts = [0] * max(1, math.ceil(t1 - t0))
    for rec in batch.records:
        if rec.error is None and t0 <= rec.end < t1:
            counts[min(len(counts) - 1, int(rec.end - t0))] += 1
    return counts


def _figures(
    name: str,
    buckets: list[int],
    lead_s: float,
    n: int,
    wall: float,
    best: float,
    pre: int,
    probes: int,
    quiet: bool = False,
) -> dict[str, Any]:
    """One method's row: time to 0.95 of best, share at or above it, whole-run rate share, and costs."""
    reached = next((i + 1 for i, c in enumerate(buckets) if c >= TARGET * best), None)
    row = {
        "method": name,
        "reach_0.95_s": None if reached is None else round(lead_s + reached, 1),
        "share_at_0.95": round(sum(1 for c in buckets if c >= TARGET * best) / (len(buckets) + lead_s), 3),
        "rollouts_per_s": round(n / wall, 1),
        "of_best": round(n / wall / best, 3),
        "preemptions_per_1k": round(1000 * pre / n, 1),
        "probe_rollouts": probes,
    }
    if not quiet:
        print(_line(row))
    return row


def _line(row: dict[str, Any]) -> str:
    to_target = "never" if row["reach_0.95_s"] is None else f"{row['reach_0.95_s']:5.1f} s"
    probes = "-" if row["probe_rollouts"] is None else f"{row['probe_rollouts']:,}"
    return (
        f"  {row['method']:<16} reach 0.95 of best: {to_target:>7} | share of run at >= 0.95: "
        f"{row['share_at_0.95']:4.2f} | whole run {row['rollouts_per_s']:7.1f}/s = {row['of_best']:4.2f} of "
        f"best | preemptions/1k {row['preemptions_per_1k']:6.1f} | probe rollouts {probes:>6}"
    )


async def _controlled(
    ctx: Any, feed: Any, n: int, control: Callable[[], Any]
) -> tuple[RolloutBatch, float, float]:
    """Collect n rollouts under `control` (an async context manager factory); the batch and its span."""
    batch = RolloutBatch()
    items = await feed.next(n)
    t0 = time.perf_counter()
    async with control():
        await run_rollouts(ctx, items, batch)
    return batch, t0, time.perf_counter()


async def run_methods(
    url: str,
    hidden_url: str | None,
    n: int,
    start: int,
    backend: dict[str, Any] | None = None,
    sweep_levels: tuple[int, ...] | None = None,
    rounds: int = 2,
) -> list[dict[str, Any]]:
    """The sweep, then rounds of the best fixed value and each controller from a cold start on n rollouts,
    in an order rotated each round, each controller judged against the fixed value of its own round (a
    machine's speed drifts between minutes; a pair in one round shares it); tune-then-hold once, judged
    against the rounds' median fixed rate. hidden_url: that engine, no gauges; `backend`: the kind and
    model when not the simulator's agent."""
    work = Path(tempfile.mkdtemp(prefix="rollflow-bench-controllers-"))
    ctx, plan = _context(url, work, n * (3 * rounds + 8) + 20_000, backend)
    feed = _feed(ctx, plan)
    levels, per_level = sweep_levels or SWEEP, max(300, n // 4)
    sweep = {p: await measure(ctx, plan, feed, p, n=per_level) for p in levels}
    best_p = max(sweep.items(), key=lambda kv: kv[1])[0]
    print("  fixed sweep: " + ", ".join(f"{p}: {r:.1f}/s" for p, r in sweep.items()) + f" (best {best_p})")

    async def fixed() -> tuple[RolloutBatch, float, float]:
        ctx.limit.set_limit(best_p)
        return await _controlled(ctx, feed, n, _nothing)

    async def engine(rule: Any = None) -> tuple[RolloutBatch, float, float]:
        ctx.limit.set_limit(start)
        return await _under_engine(ctx, feed, n, rule)

    methods: dict[str, Callable[[], Awaitable[tuple[RolloutBatch, float, float]]]] = {
        f"best fixed ({best_p})": fixed, "engine": engine, "prime-rl rules": lambda: engine(prime_rl_rule),
    }  # fmt: skip
    names = list(methods)
    runs: dict[str, list[tuple[list[int], float, int]]] = {name: [] for name in names}
    for k in range(rounds):
        order = names[k % len(names) :] + names[: k % len(names)]
        print(f"  round {k + 1}: {', '.join(order)}")
        for name in order:
            pre0 = _preemptions(url)
            batch, t0, t1 = await methods[name]()
            runs[name].append((_buckets(batch, t0, t1), t1 - t0, _preemptions(url) - pre0))
    fixed_rates = [n / wall for _, wall, _ in runs[names[0]]]
    best = statistics.median(fixed_rates)
    print("  best fixed rounds: " + ", ".join(f"{r:.1f}/s" for r in fixed_rates))
    lines = [_paired(name, runs[name], fixed_rates, n) for name in names]
    lines[0]["sweep"] = {str(p): round(r, 1) for p, r in sweep.items()}
    pre0, t_start = _preemptions(url), time.perf_counter()
    d, t = await diagnose_and_tune(ctx, plan, feed)
    probes = d.probe_rollouts + t.probe_rollouts
    ctx.limit.set_limit(t.chosen_parallelism)
    rest = max(1, n - probes)
    batch, t0, t1 = await _controlled(ctx, feed, rest, _nothing)
    held = _buckets(batch, t0, t1)
    pre = _preemptions(url) - pre0
    lines.append(
        _figures(f"tune ({t.chosen_parallelism})", held, t0 - t_start, n, t1 - t_start, best, pre, probes)
    )
    if hidden_url is not None:
        lines.append(await _latency_method(hidden_url, n, start, best))
    feed.close()
    await close_loop_session()
    return lines


def _paired(
    name: str, runs: list[tuple[list[int], float, int]], fixed: list[float], n: int
) -> dict[str, Any]:
    """One method's row over the rounds: each round judged against that round's fixed rate; the medians,
    and each round's share of the best so the spread is in the row."""
    rows = [
        _figures(f"{name} r{k + 1}", buckets, 0.0, n, wall, fixed[k], pre, 0, quiet=True)
        for k, (buckets, wall, pre) in enumerate(runs)
    ]
    reached = [r["reach_0.95_s"] for r in rows]
    row = {
        "method": name,
        "reach_0.95_s": None if None in reached else statistics.median(reached),
        "share_at_0.95": round(statistics.median(r["share_at_0.95"] for r in rows), 3),
        "rollouts_per_s": round(statistics.median(r["rollouts_per_s"] for r in rows), 1),
        "of_best": round(statistics.median(r["of_best"] for r in rows), 3),
        "of_best_each_round": [r["of_best"] for r in rows],
        "preemptions_per_1k": round(1000 * sum(pre for *_, pre in runs) / (n * len(runs)), 1),
        "probe_rollouts": None if name.startswith("best fixed") else 0,
    }
    print(_line(row) + f" | each round {row['of_best_each_round']}")
    return row


async def _under_engine(ctx: Any, feed: Any, n: int, rule: Any) -> tuple[RolloutBatch, float, float]:
    import contextlib

    @contextlib.asynccontextmanager
    async def control() -> Any:
        async with (
            sample_endpoints(ctx.pool, {}) as samplers,
            engine_control(ctx.pool, samplers, rule=rule) as group,
        ):
            yield
        for c in group.controllers.values():  # the limits it set, and its most frequent reasons
            limits = [h["limit"] for h in c.history]
            reasons = collections.Counter(h["why"].split(":")[0][:48] for h in c.history).most_common(3)
            print(f"    limit {limits[0]} -> max {max(limits)}, last {limits[-1]}; reasons {reasons}")

    return await _controlled(ctx, feed, n, control)


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()


def _feed(ctx: Any, plan: Any) -> Any:
    from rollflow.tasks.tuning.probe import ProbeFeed

    return ProbeFeed(ctx, plan)


async def _latency_method(url: str, n: int, start: int, best: float) -> dict[str, Any]:
    """The latency and 429 rules on the same engine with its gauges hidden, from `start`."""
    work = Path(tempfile.mkdtemp(prefix="rollflow-bench-latency-"))
    ctx, plan = _context(url, work, n + 1000)
    feed = _feed(ctx, plan)
    ctx.limit.set_limit(start)
    pre0 = _preemptions(url)
    batch, t0, t1 = await _controlled(ctx, feed, n, lambda: adaptive_control(ctx))
    feed.close()
    await close_loop_session()
    return _figures(
        "adaptive (lat.)", _buckets(batch, t0, t1), 0.0, n, t1 - t0, best, _preemptions(url) - pre0, 0
    )


def _simulated(profile: str, rounds: int) -> Callable[[], Awaitable[None]]:
    async def go(n: int) -> list[dict[str, Any]]:
        sim = spawn_simulator("--profile", profile, "--seed", "1")
        hidden = spawn_simulator("--profile", profile, "--seed", "1", "--metrics-format", "none")
        try:
            print(f"simulator --profile {profile}, {n:,} rollouts per method")
            return await run_methods(sim.url, hidden.url, n, start=5, rounds=rounds)
        finally:
            sim.stop()
            hidden.stop()

    return go  # type: ignore[return-value]


async def _on_vllm(n: int, max_num_seqs: int, kv_gb: float, rounds: int) -> list[dict[str, Any]]:
    from rollflow.infra.vllm.stack import VllmServer

    log_dir = Path(tempfile.mkdtemp(prefix="rollflow-bench-vllm-"))
    with VllmServer(max_num_seqs=max_num_seqs, kv_cache_gb=kv_gb, log_dir=log_dir) as server:
        print(
            f"vLLM (CPU, tiny model) max_num_seqs {max_num_seqs}, KV {kv_gb * 1024:.0f} MiB; {n:,} rollouts"
        )
        chat = {"kind": "chat", "model": server.model, "max_output_tokens": VLLM_TOKENS}
        return await run_methods(
            server.base_url, None, n, start=5, backend=chat, sweep_levels=VLLM_SWEEP, rounds=rounds
        )


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=6000)
    ap.add_argument("--profile", default="paged")
    ap.add_argument("--vllm", action="store_true", help="also on a real vLLM (installs it on first use)")
    ap.add_argument("--vllm-only", action="store_true", help="only on a real vLLM")
    ap.add_argument("--vllm-rollouts", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the fixed value and each controller")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    if not args.vllm_only:
        sim = await _simulated(args.profile, args.rounds)(args.rollouts)  # type: ignore[call-arg]
        rows += [{"engine": f"simulator ({args.profile})", **r} for r in sim]
        _save(rows, args)
    if args.vllm or args.vllm_only:
        rows += [
            {"engine": "vLLM (CPU)", **r} for r in await _on_vllm(args.vllm_rollouts, 64, 1 / 64, args.rounds)
        ]
        _save(rows, args)


def _save(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """The rows of this run, and an earlier run's rows of the engines this one did not measure."""
    measured = {r["engine"] for r in rows}
    earlier = RESULTS / "controllers.json"
    if earlier.exists():
        rows = [r for r in json.loads(earlier.read_text())["rows"] if r["engine"] not in measured] + rows
    save(
        "controllers", rows, title="Concurrency controllers side by side", params=vars(args),
        goal=">= 0.95 of the best fixed rate over the whole run, in half the probing rollouts of "
        "tune-then-hold, with no more preemptions than the best fixed value",
    )  # fmt: skip


if __name__ == "__main__":
    asyncio.run(main())
