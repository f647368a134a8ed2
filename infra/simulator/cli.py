"""The simulator's command line (`python -m rollflow.infra.simulator`, `rollflow simulate`): one backend, or
several replicas of unequal slots and latency in one process (`--replica 16x100 --replica 64x100`).

`--profile` picks the capacity model and its defaults (profiles.py); explicit flags override a profile's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import signal
import sys
from collections.abc import Callable

from rollflow.infra.simulator.config import DIFFICULTIES, METRICS_FORMATS, SimConfig, parse_fault_kinds
from rollflow.infra.simulator.profiles import PROFILES
from rollflow.infra.simulator.server import RunningSimulator, start_simulator


def parse_replica(text: str) -> tuple[int, float]:
    """'16x100' -> (16 slots, 100.0 ms); anything else is an error saying what is expected."""
    slots, sep, latency = text.lower().partition("x")
    try:
        if not sep:
            raise ValueError
        return int(slots), float(latency)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--replica expects SLOTSxLATENCY_MS such as 16x100, got {text!r}"
        ) from None


BATCHING_FLAGS: dict[str, tuple[type, str]] = {
    "step_ms": (float, "decode step's base cost; a step takes step_ms + seq_step_ms * running"),
    "seq_step_ms": (float, "decode step's cost per running sequence"),
    "max_num_seqs": (int, "at most this many sequences run at once; the rest wait"),
    "kv_tokens": (int, "KV-cache size; each request reserves its output + kv_prompt_tokens while it runs"),
    "kv_blocks": (
        int,
        "a paged KV cache of this many blocks: a request holds its prompt and what it has "
        "decoded so far; when the cache fills, the youngest running request is preempted",
    ),
    "block_size": (int, "tokens per KV block (with --kv-blocks)"),
    "kv_prompt_tokens": (int, "KV tokens a request's prompt holds"),
    "prefill_tokens": (
        int,
        "extra decode-step work per request, as for prefilling its prompt (none when "
        "its prompt is in the prefix cache)",
    ),
    "prefix_cache_prompts": (int, "the prefix cache keeps the last this many prompts"),
    "preempt_after": (int, "past this many running, preemption divides each sequence's rate further"),
    "recompute": (
        float,
        "rate / (1 + recompute * (running - preempt_after) / preempt_after); with "
        "--kv-blocks, decode steps a preempted request spends per token recomputed",
    ),
}


def make_parser() -> argparse.ArgumentParser:
    """The CLI of `python -m rollflow.infra.simulator` and `rollflow simulate`; defaults from SimConfig."""
    d = SimConfig()
    p = argparse.ArgumentParser(prog="rollflow simulate", description="The simulated inference backend.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on start)")
    p.add_argument(
        "--profile",
        choices=PROFILES,
        default="sharp",
        help="capacity model and its defaults: "
        + "; ".join(f"{name}: {profile.summary}" for name, profile in PROFILES.items()),
    )
    p.add_argument(
        "--slots", type=int, default=d.slots, help="sharp: requests served at once; the rest queue FIFO"
    )
    p.add_argument("--latency-ms", type=float, default=d.latency_ms, help="sharp: base service time")
    p.add_argument("--per-token-ms", type=float, default=d.per_token_ms, help="sharp: added per output token")
    p.add_argument(
        "--contention",
        type=float,
        default=d.contention,
        help="sharp: service time x (1 + contention * (busy - 1) / slots)",
    )
    for name, (kind, text) in BATCHING_FLAGS.items():
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, type=kind, default=None, help=f"batching profiles: {text}")
    p.add_argument(
        "--jitter", type=float, default=d.jitter, help="service time varies uniformly by +-this fraction"
    )
    p.add_argument("--max-queue", type=int, default=None, help="beyond this many waiting, answer 503")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--correct-rate", type=float, default=d.correct_rate, help="share of correct answers")
    p.add_argument(
        "--difficulty",
        choices=DIFFICULTIES,
        default=d.difficulty,
        help="flat: every prompt at --correct-rate; spread: --settled-share of prompts always or never "
        "solved, the rest at a per-prompt rate in [0.2, 0.8]",
    )
    p.add_argument(
        "--settled-share", type=float, default=d.settled_share, help="spread: share always or never solved"
    )
    p.add_argument(
        "--fault-rate", type=float, default=d.fault_rate, help="probability of a fault per request"
    )
    p.add_argument(
        "--fault-kinds",
        default=",".join(d.fault_kinds),
        help="from 429,500,503,reset,hang,malformed,error_object (HTTP 200 with an error object), "
        "null_reward (/run answers reward null)",
    )
    p.add_argument(
        "--retry-after-s", type=float, default=d.retry_after_s, help="Retry-After of injected 429s"
    )
    p.add_argument("--hang-s", type=float, default=d.hang_s, help="how long an injected hang holds a request")
    p.add_argument("--min-tokens", type=int, default=None, help=f"default {d.min_tokens}, 16 when batching")
    p.add_argument("--max-tokens", type=int, default=None, help=f"default {d.max_tokens}, 48 when batching")
    p.add_argument(
        "--metrics-format",
        choices=METRICS_FORMATS,
        default=d.metrics_format,
        help="GET /metrics as vLLM or SGLang publish it, none (404) or garbage",
    )
    p.add_argument(
        "--replica",
        action="append",
        type=parse_replica,
        default=[],
        metavar="SLOTSxLATENCY_MS",
        help="serve one more replica with these slots and latency, on the next port (repeatable); "
        "with a batching profile, SLOTS is its max_num_seqs and LATENCY_MS its step_ms",
    )
    return p


def profile_settings(args: argparse.Namespace) -> dict[str, object]:
    """The profile's settings with explicit flags laid over them; batching flags refused for `sharp`."""
    settings = dict(PROFILES[args.profile].settings)
    given = {name: getattr(args, name) for name in BATCHING_FLAGS if getattr(args, name) is not None}
    if given and settings.get("model") != "batching":
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ValueError(
            f"{flags} apply to the batching profiles (batching, kv-limited, paged, preempting), not sharp"
        )
    settings.update(given)
    for name in ("min_tokens", "max_tokens"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    return settings


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """SimConfig from parsed CLI flags over the profile's defaults; ValueError names a bad one."""
    return SimConfig(
        slots=args.slots, latency_ms=args.latency_ms, per_token_ms=args.per_token_ms,
        contention=args.contention, jitter=args.jitter, max_queue=args.max_queue, seed=args.seed,
        correct_rate=args.correct_rate, difficulty=args.difficulty, settled_share=args.settled_share,
        fault_rate=args.fault_rate, fault_kinds=parse_fault_kinds(args.fault_kinds),
        retry_after_s=args.retry_after_s,
        hang_s=args.hang_s, metrics_format=args.metrics_format,
        **profile_settings(args),  # type: ignore[arg-type]
    )  # fmt: skip


def replica_configs(base: SimConfig, replicas: list[tuple[int, float]]) -> list[SimConfig]:
    """One config per replica (the base alone without --replica); each replica has its own copy (and engine).

    SLOTSxLATENCY_MS means slots and latency_ms for the slots model, max_num_seqs and step_ms for batching.
    """
    if not replicas:
        return [base]
    if base.model == "batching":
        return [dataclasses.replace(base, max_num_seqs=n, step_ms=step) for n, step in replicas]
    return [dataclasses.replace(base, slots=slots, latency_ms=latency) for slots, latency in replicas]


async def _serve_forever(configs: list[SimConfig], host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before the "listening" line: a parent may stop us at once
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    sims: list[RunningSimulator] = []
    try:
        for i, config in enumerate(configs):
            sims.append(await start_simulator(config, host, port + i if port else 0))
            print(f"rollflow simulator listening on {sims[-1].url}", flush=True)
        await stop.wait()
    finally:
        for sim in sims:
            await sim.close()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when it is installed (it roughly halves the server's CPU per request), else asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: list[str] | None = None) -> int:
    """Run the simulator until SIGTERM/SIGINT; 2 on a bad flag."""
    args = make_parser().parse_args(argv)
    try:
        configs = replica_configs(config_from_args(args), args.replica)
    except ValueError as exc:
        print(f"rollflow simulate: {exc}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=_loop_factory()) as runner:
        runner.run(_serve_forever(configs, args.host, args.port))
    return 0
