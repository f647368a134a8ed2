"""Tuning against a real continuous-batching engine on CPU: `transformers serve --continuous-batching`.

What it measures. The engine (Hugging Face transformers' OpenAI-compatible server with paged-attention
continuous batching) is installed from PyPI into a venv of its own under the cache dir (reused when
present), serves a small randomly initialised Llama-style model built locally (bench/real_engine_model.py:
no model hub), and every request generates exactly MAX_TOKENS tokens (the model has no end-of-sequence
token). rollflow drives the load through its own library, as bench/tuning.py does: a planned chat run
(NeMo Gym rows sent as chat messages, rewarded by exact_match: a string compare that costs nothing next to
the engine; "none" would leave chat rollouts without a reward) and probe steps at a fixed parallelism,
whose steady rate comes from the request timeline (throughput.measure_step). Sweep points, probes and
pairings all take fresh rows of one input, so none repeats another's requests.
1. The engine's curve: a fixed-parallelism sweep, --rounds rounds (2; ascending, then descending),
   --rollouts rollouts a point (600); the two best levels (mean over the rounds) are the reference points.
2. --tunings runs (5) of rollflow's diagnose + tune (`tune(..., seeds=[d.low, d.high])`), each followed by a
   pairing: its choice and the two best sweep levels measured back to back, --pair-rollouts (600) each in two
   halves run A B C then C B A (the order alternating between tunings), so the choice's share of the best
   is read at one moment of a machine whose load drifts.
Goal: every choice >= 0.90 of the best point's rate measured in its pairing, and the median >= 0.95.

Each sweep step prints the cores that other processes kept busy meanwhile (from /proc), and each pairing
the most of its steps: on a shared machine a step read while something else ran reads the engine short,
so a sweep step that saw over DISTURBED_CORES is measured once more (the second reading is kept).
With torch's default threads (one per core) the engine's OpenMP threads spin-wait for each other, and one
busy process beside it cuts its rate about tenfold (22 -> 2 rollouts/s at 8 in flight, 45 -> 6 at 48,
measured); `--engine-threads 1` loses a quarter of the peak but only ~10-25% to such a neighbour.

A benchmark, not a test: it prints its figures and asserts none. `--quick` is a smoke run (one round of
three levels, 150 rollouts each, one tuning). Traffic stays on 127.0.0.1; the engine runs in a process
group of its own, stopped at the end (killed on error).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import write_input

from rollflow.infra.local import free_port, wait_http
from rollflow.settings import RollflowSettings, RunSpec
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.collect.plan import RunPlan, plan_run
from rollflow.tasks.collect.rollouts import CollectContext
from rollflow.tasks.collect.runtime import collect_context, open_run
from rollflow.tasks.tuning.diagnose import diagnose
from rollflow.tasks.tuning.probe import ProbeFeed, probe_step
from rollflow.tasks.tuning.tune import TuneOptions, tune

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "rollflow-bench"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Pinned: the versions this bench was tuned with (the engine's CPU speed shapes the curve).
TORCH = "torch==2.13.0"
ENGINE_PINS = [
    "transformers[serving]==5.24.0",
    "tokenizers==0.23.3",
    "accelerate==1.15.0",
    "fastapi==0.165.0",
    "starlette==1.10.0",
    "uvicorn==0.54.0",
    "openai==3.57.0",
    "pydantic==2.14.4",
]
MODEL = {"layers": 4, "hidden": 512, "heads": 8, "vocab": 2048}
MAX_TOKENS = 24
LEVELS = [4, 8, 12, 16, 24, 32, 48, 64, 96]
QUICK_LEVELS = [8, 24, 48]
REQUEST_TIMEOUT_S = 120.0
# The KV cache's share of RAM: on CPU the engine takes 60% by default (~7 GB resident on this 24 GiB
# machine); 8% holds hundreds of these short requests at once (measured up to 320 in flight) at ~1.3 GB.
KV_MEMORY_SHARE = 0.08
# A sweep step during which other processes kept this many cores busy is measured once more.
DISTURBED_CORES = 0.25


# ---- the engine: install, model, process ----------------------------------------------------------


def _run(cmd: list[str], timeout_s: float) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout


def _cpu_index_reachable() -> bool:
    try:
        urllib.request.urlopen(f"{CPU_INDEX}/torch/", timeout=5).close()
        return True
    except OSError:
        return False


def ensure_engine(venv: Path) -> tuple[Path, str]:
    """The engine venv's python (installed when missing or pinned differently), and how it was had."""
    marker = venv / "rollflow-bench.json"
    want = {"torch": TORCH, "pins": ENGINE_PINS}
    python = venv / "bin" / "python"
    if marker.exists() and json.loads(marker.read_text()) == want and python.exists():
        return python, "reused"
    shutil.rmtree(venv, ignore_errors=True)
    t0 = time.perf_counter()
    _run([sys.executable, "-m", "venv", str(venv)], 120)
    pip = [str(python), "-m", "pip", "install", "-q"]
    cpu_index = _cpu_index_reachable()
    _run([*pip, *(["--index-url", CPU_INDEX] if cpu_index else []), TORCH], 1800)
    _run([*pip, *ENGINE_PINS], 1800)
    marker.write_text(json.dumps(want))
    source = "the PyTorch CPU index" if cpu_index else "PyPI (pip's configured indexes)"
    return python, f"installed in {time.perf_counter() - t0:.0f} s (torch from {source})"


def engine_versions(python: Path) -> str:
    code = (
        "import importlib.metadata as m; print(', '.join(f'{p} {m.version(p)}' for p in "
        "('torch', 'transformers', 'tokenizers', 'fastapi', 'uvicorn', 'openai')))"
    )
    return _run([str(python), "-c", code], 60).strip()


def ensure_model(python: Path) -> tuple[Path, dict[str, Any]]:
    """The model directory for MODEL (built by bench/real_engine_model.py when missing), and its figures."""
    name = "-".join(f"{k}{v}" for k, v in MODEL.items())
    out = CACHE / f"real-engine-model-{name}"
    info = out / "bench_model.json"
    if not info.exists():
        flags = [a for k, v in MODEL.items() for a in (f"--{k}", str(v))]
        stdout = _run([str(python), str(HERE / "real_engine_model.py"), str(out), *flags], 600)
        info.write_text(stdout.strip().splitlines()[-1])
    return out, json.loads(info.read_text())


@dataclass
class Engine:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        """SIGTERM to the engine's whole process group, SIGKILL if it lingers; any straggler is killed."""
        for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            if self.proc.poll() is not None:
                break
            self._signal(sig)
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                continue
        self._signal(signal.SIGKILL)  # the group outlives its leader if a child of it still runs

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)


def start_engine(python: Path, model: Path, log: Path, threads: int = 0) -> Engine:
    """`transformers serve MODEL --continuous-batching` on 127.0.0.1, in a process group of its own;
    `threads` sets torch's threads (OMP_NUM_THREADS; 0 keeps torch's default, one per core)."""
    port = free_port()
    exe = python.with_name("transformers")
    cmd = [str(exe), "serve", str(model), "--continuous-batching", "--device", "cpu", "--dtype", "float32"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    cmd += ["--cb-max-memory-percent", str(KV_MEMORY_SHARE)]
    with log.open("wb") as fh:
        env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    engine = Engine(proc, f"http://127.0.0.1:{port}", log)
    try:
        wait_http(f"{engine.url}/health", 180, proc)
    except Exception as exc:
        engine.stop()
        raise RuntimeError(f"the engine did not come up: {exc}\n{log.read_text()[-3000:]}") from exc
    return engine


# ---- rollflow's side: a planned chat run and fixed-parallelism steps -------------------------------


TICK = os.sysconf("SC_CLK_TCK")


def _busy_s() -> float:
    """CPU seconds the machine's cores spent busy since boot (/proc/stat: all but idle and iowait)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / TICK


def _process_s(pid: int) -> float:
    """CPU seconds of process `pid`, all its threads (utime + stime of /proc/PID/stat); 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


@dataclass
class Load:
    ctx: CollectContext
    plan: RunPlan
    feed: ProbeFeed
    engine_pid: int

    def cpu(self) -> tuple[float, float, float]:
        """(now, the machine's busy CPU-s, the engine's and this process's CPU-s), to difference."""
        ours = _process_s(self.engine_pid) + sum(os.times()[:2])
        return time.perf_counter(), _busy_s(), ours


def others_cores(a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
    """Cores that processes other than the engine and this one kept busy between two Load.cpu() readings:
    this machine is shared, and a step measured while something else ran reads the engine short."""
    return max(0.0, (b[1] - a[1]) - (b[2] - a[2])) / max(b[0] - a[0], 1e-9)


def open_load(engine: Engine, model: Path, work: Path, rows: int) -> Load:
    """A planned chat run over `rows` NeMo Gym rows, each asking for MAX_TOKENS tokens."""
    inp = write_input(work / "input.jsonl", rows)
    spec = RunSpec(
        input=str(inp),
        output=str(work / "out"),
        backend={"kind": "chat", "url": engine.url, "model": str(model), "timeout_s": REQUEST_TIMEOUT_S},
        collection={"chunk_size": 1000, "overrides": {"max_output_tokens": MAX_TOKENS}},
        verify={"verifier": "exact_match"},  # a reward is required; "none" leaves chat rows without one
    )
    settings = RollflowSettings()
    handles = open_run(spec, settings)
    plan = plan_run(spec, handles.store, handles.ledger, handles.input_options, None)
    ctx = collect_context(handles, settings, 1)
    return Load(ctx, plan, ProbeFeed(ctx, plan), engine.proc.pid)


async def measure(load: Load, p: int, n: int, label: str) -> tuple[float, float]:
    """Steady rollouts/s of `n` fresh rollouts at exactly `p` in flight (0 when the input ran out), and the
    cores other processes used meanwhile."""
    items = await load.feed.next(n)
    if not items:
        return 0.0, 0.0
    before = load.cpu()
    step = await probe_step(load.ctx, items, p, chunks=load.plan.scan.chunks, label=f"{label}-p{p}")
    if step.errors:
        print(f"    ({step.errors} of {step.rollouts} failed at {p}: {step.measure.errors})")
    return step.rollouts_per_s, others_cores(before, load.cpu())


@dataclass
class Curve:
    rates: dict[int, list[float]] = field(default_factory=dict)

    def mean(self, p: int) -> float:
        return statistics.mean(self.rates[p])

    def best(self, k: int = 2) -> list[int]:
        return sorted(self.rates, key=self.mean, reverse=True)[:k]


async def sweep(load: Load, levels: list[int], rounds: int, n: int) -> Curve:
    """The engine's curve: every level `rounds` times (ascending, then descending, ...), n rollouts each."""
    curve = Curve({p: [] for p in levels})
    for r in range(rounds):
        for p in levels if r % 2 == 0 else levels[::-1]:
            rate = await sweep_point(load, p, n, r)
            curve.rates[p].append(rate)
    return curve


async def sweep_point(load: Load, p: int, n: int, r: int) -> float:
    """One sweep step, measured once more (and that one kept) when other processes took CPU meanwhile."""
    for attempt in range(2):
        t0 = time.perf_counter()
        rate, others = await measure(load, p, n, f"sweep{r + 1}")
        print(f"    round {r + 1}: {p:>3} in flight {rate:6.1f}/s ({time.perf_counter() - t0:.0f} s; "
              f"other processes used {others:.2f} cores)", flush=True)  # fmt: skip
        if others <= DISTURBED_CORES or attempt:
            return rate
        print("    (disturbed: measured again)")
    return rate


def print_curve(curve: Curve, rounds: int) -> None:
    top = max(curve.mean(curve.best(1)[0]), 1e-9)
    heads = "".join(f"  round {r + 1:>1}" for r in range(rounds))
    print(f"  in flight{heads}     mean  share of best")
    for p, rates in curve.rates.items():
        cells = "".join(f"{x:>9.1f}" for x in rates)
        mark = "  <- best" if p in curve.best() else ""
        print(f"  {p:>9}{cells}{curve.mean(p):>9.1f}{curve.mean(p) / top:>15.2f}{mark}")


# ---- tunings, each measured against the best sweep points at the same moment ------------------------


@dataclass
class Trial:
    chosen: int
    knee: int
    stop: str
    verdict: str
    probe_rollouts: int
    wall_s: float
    rates: dict[int, float]
    bests: list[int]
    others: float = 0.0  # the most cores other processes used in a step of the pairing
    curve: str = ""  # the tuner's steps: phase (seed = the diagnosis) parallelism:rollouts/s

    @property
    def share(self) -> float:
        return self.rates[self.chosen] / max(self.rates[p] for p in self.bests)


async def pairing(load: Load, levels: list[int], n: int, i: int) -> tuple[dict[int, float], float]:
    """Each level's mean rate over two halves of `n` rollouts run A B C, then C B A (A B C starting with
    the choice on even `i`, with the best points on odd): a drift of the machine's load over the pairing
    weighs on every level alike. Also the most cores other processes used in any of its steps."""
    order = levels if i % 2 == 0 else levels[::-1]
    rates: dict[int, list[float]] = {p: [] for p in levels}
    others = 0.0
    for seq in (order, order[::-1]):
        for p in seq:
            rate, used = await measure(load, p, n // 2, f"pair{i}")
            rates[p].append(rate)
            others = max(others, used)
    return {p: statistics.mean(r) for p, r in rates.items()}, others


async def one_tuning(load: Load, bests: list[int], n: int, i: int) -> Trial:
    """diagnose + tune as bench/tuning.py runs them, then the pairing (order alternating with `i`)."""
    t0 = time.perf_counter()
    d = await diagnose(load.ctx, load.plan, feed=load.feed)
    t = await tune(load.ctx, load.plan, TuneOptions(), feed=load.feed, seeds=[d.low, d.high])
    wall = time.perf_counter() - t0
    rates, others = await pairing(load, list(dict.fromkeys([t.chosen_parallelism, *bests])), n, i)
    return Trial(
        chosen=t.chosen_parallelism,
        knee=t.knee,
        stop=t.stop_reason,
        verdict=d.verdict,
        probe_rollouts=d.probe_rollouts + t.probe_rollouts,
        wall_s=wall,
        rates=rates,
        bests=bests,
        others=others,
        curve=" ".join(f"{st.phase} {st.parallelism}:{st.rollouts_per_s:.1f}" for st in t.steps),
    )


def print_trial(i: int, tr: Trial) -> None:
    pairs = ", ".join(f"{p}: {tr.rates[p]:.1f}/s" for p in sorted(tr.rates))
    print(
        f"  tuning {i + 1}: chose {tr.chosen:>3} (knee {tr.knee}, stop: {tr.stop}, {tr.verdict}) | "
        f"{tr.probe_rollouts:,} probe rollouts in {tr.wall_s:.0f} s | pairing {pairs} | "
        f"{tr.share:.2f} of the best (other processes: up to {tr.others:.2f} cores)",
        flush=True,
    )
    print(f"    its steps (phase in flight:rollouts/s): {tr.curve}")


def print_goal(trials: list[Trial]) -> None:
    shares = [tr.share for tr in trials]
    print(
        f"  share of the best over {len(shares)} tunings: min {min(shares):.2f}, median "
        f"{statistics.median(shares):.2f}; choices {sorted(tr.chosen for tr in trials)}; probe rollouts "
        f"median {statistics.median(tr.probe_rollouts for tr in trials):,.0f}, tuning wall time median "
        f"{statistics.median(tr.wall_s for tr in trials):.0f} s"
    )
    print("  goal: every choice >= 0.90 of the best, the median >= 0.95")


# ---- the run -------------------------------------------------------------------------------------


def rows_needed(args: argparse.Namespace, levels: list[int]) -> int:
    """Fresh rows for everything (a tuning spends at most a few thousand): no step ever runs short."""
    return args.rounds * len(levels) * args.rollouts + args.tunings * (8_000 + 3 * args.pair_rollouts) + 500


async def bench(args: argparse.Namespace, engine: Engine, model: Path, work: Path) -> None:
    levels = QUICK_LEVELS if args.quick else LEVELS
    load = open_load(engine, model, work, rows_needed(args, levels))
    try:
        await measure(load, 8, 48, "warmup")  # the first request starts the batching worker
        print(f"engine curve: fixed parallelism, {args.rollouts} rollouts a point, {args.rounds} round(s)")
        curve = await sweep(load, levels, args.rounds, args.rollouts)
        print_curve(curve, args.rounds)
        bests = curve.best()
        print(f"tunings: diagnose + tune, then the choice against the best points {bests} "
              f"({args.pair_rollouts} rollouts each, back to back: A B C C B A)")  # fmt: skip
        trials = []
        for i in range(args.tunings):
            trials.append(await one_tuning(load, bests, args.pair_rollouts, i))
            print_trial(i, trials[-1])
        print_goal(trials)
    finally:
        load.feed.close()
        await close_loop_session()


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round of 3 levels x 150, 1 tuning")
    ap.add_argument("--rollouts", type=int, default=600, help="rollouts per sweep point")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the sweep")
    ap.add_argument("--tunings", type=int, default=5)
    ap.add_argument("--pair-rollouts", type=int, default=600, help="rollouts per point of a pairing")
    ap.add_argument("--max-minutes", type=float, default=60.0, help="the whole load phase stops after this")
    ap.add_argument(
        "--engine-threads",
        type=int,
        default=0,
        help="torch threads of the engine (default: torch's, one per core; 1 degrades gracefully when "
        "other processes take CPU, at ~3/4 of the peak)",
    )
    ap.add_argument("--venv", type=Path, default=CACHE / "real-engine-venv", help="the engine's venv")
    args = ap.parse_args()
    if args.quick:
        args.rollouts, args.rounds, args.tunings, args.pair_rollouts = 150, 1, 1, 150
    return args


async def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the engine
    CACHE.mkdir(parents=True, exist_ok=True)
    python, how = ensure_engine(args.venv)
    print(f"engine venv {args.venv}: {how}; {engine_versions(python)}")
    model, info = ensure_model(python)
    print(f"model {model}: Llama, {info['layers']} layers, hidden {info['hidden']}, {info['heads']} heads, "
          f"vocab {info['vocab']} (byte-level BPE), {info['params'] / 1e6:.1f} M parameters, random "
          f"weights; {MAX_TOKENS} tokens a request (no EOS)")  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="rollflow-bench-real-engine-"))
    try:
        engine = start_engine(python, model, work / "engine.log", args.engine_threads)
        threads = args.engine_threads or "torch's default"
        print(f"engine: transformers serve --continuous-batching on {engine.url} (pid {engine.proc.pid}, "
              f"torch threads: {threads})")  # fmt: skip
        try:
            await asyncio.wait_for(bench(args, engine, model, work), timeout=args.max_minutes * 60)
        finally:
            engine.stop()
            if engine.proc.returncode not in (0, -signal.SIGTERM):
                print(f"engine exited {engine.proc.returncode}; log tail:\n{engine.log.read_text()[-2000:]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
