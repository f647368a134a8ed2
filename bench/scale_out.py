"""Many worker processes on one backend: the local runner, Dask with 2 workers and Ray with 2 workers.

The backend is the simulator at 32 slots x 50 ms (640 rollouts/s at most); 12,000 rollouts at
--parallelism 32, in this order, each twice. Everything runs inside a network namespace of its own with
only a loopback interface (the script re-executes itself under `unshare -rn --pid --fork --mount-proc`):
outside one, Ray's processes talk over the machine's own address. The local runner runs twice (its first
run also pays the Prefect server's warm-up), before Dask and again before Ray: this machine's speed
drifts over minutes, so each engine is compared with the local runs just before it. Dask is a
`dask scheduler` with two `dask worker` processes
(2 threads each, with rollflow's `--preload` and `--preload-nanny`), run on the fresh cluster, then again
on the same workers, as a long-lived cluster serves runs; Ray is a head node
and a second node started with `ray start --address`, one CPU each (one chunk per worker process at a
time), also run twice (Ray starts a job's worker processes anew for each run), then twice more with
`--ray-keep-workers-s`: the first starts the warm workers, the second finds them; last, on a fresh Ray
cluster whose warm workers `rollflow ray-workers` started with it (not measured, as Dask's workers'
start is not), one run that finds them. Dask's and Ray's rows are
compared with the better of the two local runs just before them: its rate, and its CPU per rollout.

Figures per row: the collect stage's rate (report.json `collect_rollouts_per_s`, which includes the
engine's task start-up) as a share of 640/s, and CPU ms per rollout: the `rollflow run` command (from
RUSAGE_CHILDREN) plus every worker process (CPU-time deltas read with psutil five times a second while the
run goes, as Ray ends a job's worker processes with it),
shown separately from the engine's own daemons (Dask's scheduler; Ray's raylet, GCS and agents). The
simulator and the Prefect server are not counted. Last, the zero-latency client ceiling of one worker
process: rollouts per CPU-second of each Dask worker against a zero-latency simulator (24,000 rollouts,
--parallelism 64), which is what one worker process can push on one core of this machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
from cpumeter import CpuMeter
from harness import spawn_prefect_server, spawn_simulator, write_input
from pyspy import Profiler, rollflow_command, summary
from results import save
from timeline import Timeline

from rollflow.infra.local import free_port

ROLLOUTS = int(os.environ.get("ROLLFLOW_BENCH_ROLLOUTS", "12000"))
PARALLELISM, SLOTS, LATENCY_MS = 32, 32, 50.0
PROFILE = os.environ.get("ROLLFLOW_BENCH_PROFILE")  # a folder: py-spy profiles of every run go there
PROCESSES = os.environ.get("ROLLFLOW_BENCH_PROCESSES") == "1"  # each engine process's CPU, after each run
TIMELINE = os.environ.get("ROLLFLOW_BENCH_TIMELINE") == "1"  # the backend's in-flight count over each run
SIMULATOR: list[str] = []  # the simulator's URL, once started
CHUNK_SIZE = os.environ.get("ROLLFLOW_BENCH_CHUNK_SIZE", "auto")  # --chunk-size of every run
CAPACITY = SLOTS / (LATENCY_MS / 1000)
RAY_KEEP_S = 600  # --ray-keep-workers-s of the last two Ray runs: the second finds the first's workers
BIN = Path(sys.executable).parent
ROLLFLOW = str(BIN / "rollflow")
PRELOAD = "rollflow.tasks.wrappers.preload"
PRELOAD_NANNY = "rollflow.tasks.wrappers.preload_nanny"
INSIDE = "ROLLFLOW_BENCH_NETNS"


@dataclass
class Row:
    name: str
    rollouts: int
    collect_s: float
    rate: float
    cli_cpu_s: float
    worker_cpu_s: float
    daemon_cpu_s: float

    @property
    def cpu_per_rollout(self) -> float:
        return (self.cli_cpu_s + self.worker_cpu_s) / self.rollouts

    def line(self) -> str:
        ms = 1000 * (self.cli_cpu_s + self.worker_cpu_s) / self.rollouts
        daemons = 1000 * self.daemon_cpu_s / self.rollouts
        split = (
            f"{1000 * self.cli_cpu_s / self.rollouts:.2f} + {1000 * self.worker_cpu_s / self.rollouts:.2f}"
        )
        return (
            f"| {self.name} | {self.rollouts:,} | {self.collect_s:.1f} | {self.rate:,.0f} | "
            f"{self.rate / CAPACITY:.2f} | {ms:.2f} ({split}) | {daemons:.2f} |"
        )


def engine_kind(proc: psutil.Process) -> str | None:
    """ "worker" for a Dask worker (its nanny and the process it spawns) or a Ray worker process (`ray::`
    but a node's agents), "daemon" for the engine's other processes (Dask's scheduler; Ray's raylet, GCS,
    agents), else None."""
    cmd = " ".join(proc.cmdline())
    if cmd.startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent")):  # each node's agents
        return "daemon"
    if "dask worker" in cmd or "multiprocessing.spawn" in cmd or cmd.startswith("ray::"):
        return "worker"
    if "dask scheduler" in cmd or "resource_tracker" in cmd or "/ray/" in cmd or "ray start" in cmd:
        return "daemon"
    return None


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_line(log: Path, text: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in log.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise TimeoutError(f"{log}: no {text!r} within {timeout_s:.0f} s")


def dask_cluster(env: dict[str, str], logs: Path) -> tuple[str, list[psutil.Process]]:
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    scheduler = start(
        [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
        env,
        logs / "scheduler.log",
    )
    workers = [
        start(
            [
                str(BIN / "dask"),
                "worker",
                address,
                "--nthreads",
                "2",
                "--host",
                "127.0.0.1",
                "--no-dashboard",
                "--preload",
                PRELOAD,
                "--preload-nanny",
                PRELOAD_NANNY,
            ],
            env,
            logs / f"worker-{i}.log",
        )
        for i in range(2)
    ]
    for i in range(2):
        wait_for_line(logs / f"worker-{i}.log", "Registered to:")
    return address, [psutil.Process(p.pid) for p in (scheduler, *workers)]


def ray_cluster(env: dict[str, str], logs: Path) -> tuple[str, list[psutil.Process], dict[str, str]]:
    tmp = Path(tempfile.mkdtemp(prefix="rfb-", dir="/tmp"))
    ray_env = {**env, "RAY_AUTH_MODE": "disabled", "RAY_TMPDIR": str(tmp), "RAY_USAGE_STATS_ENABLED": "0"}
    port = free_port()
    common = ["--num-cpus=1", "--object-store-memory=134217728", "--node-ip-address=127.0.0.1",
              "--disable-usage-stats", "--block"]  # fmt: skip
    head = start(
        [str(BIN / "ray"), "start", "--head", f"--port={port}", "--include-dashboard=false",
         f"--temp-dir={tmp}", *common],
        ray_env,
        logs / "ray-head.log",
    )  # fmt: skip
    wait_for_line(logs / "ray-head.log", "will now block forever")
    node = start(
        [str(BIN / "ray"), "start", f"--address=127.0.0.1:{port}", *common], ray_env, logs / "ray-2.log"
    )
    wait_for_line(logs / "ray-2.log", "will now block forever")
    return f"127.0.0.1:{port}", [psutil.Process(head.pid), psutil.Process(node.pid)], ray_env


def run(name: str, args: list[str], env: dict[str, str], out: Path) -> tuple[Row, dict]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    tag = name.split(",")[0] + ("-again" if "second" in name else "")
    with CpuMeter(engine_kind) as meter, profiled(tag), backend_timeline(name):
        proc = subprocess.run([ROLLFLOW, *args], env=env, capture_output=True, text=True, timeout=900)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)  # before py-spy's own CPU joins it
    if proc.returncode:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    if PROCESSES:
        stages = ", ".join(f"{k} {v:.2f}" for k, v in report["stages"].items() if v)
        print(f"\n{name}: stages (s) {stages}; CPU seconds of each engine process")
        for kind in ("worker", "daemon"):
            for title, cpu in meter.by_process(kind):
                print(f"  {kind:6} {cpu:6.2f}  {title}")
    cli = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row = Row(
        name,
        report["rows_written"],
        report["stages"]["collect"],
        report["collect_rollouts_per_s"],
        cli,
        meter.seconds("worker"),
        meter.seconds("daemon"),
    )
    return row, report


def half_of(common: list[str], rows: Path) -> list[str]:
    """`common` with `rows` for its input and half its parallelism."""
    args = list(common)
    args[args.index("--input") + 1] = str(rows)
    args[args.index("--parallelism") + 1] = str(PARALLELISM // 2)
    return args


@contextlib.contextmanager
def backend_timeline(name: str) -> Iterator[None]:
    """With ROLLFLOW_BENCH_TIMELINE: the backend's in-flight count over the block, said after it."""
    if not TIMELINE:
        yield
        return
    with Timeline(SIMULATOR[0], PARALLELISM - 2) as timeline:
        yield
    print(f"\n{name}: backend {timeline.line()}")


def profiled_kind(proc: psutil.Process) -> str | None:
    """ "command" for the `rollflow run` process, "worker" for an engine's worker process, else None."""
    if rollflow_command(proc):
        return "command"
    return "worker" if engine_kind(proc) == "worker" else None


@contextlib.contextmanager
def profiled(tag: str) -> Iterator[None]:
    """With ROLLFLOW_BENCH_PROFILE: py-spy on the command and the workers, and their top functions."""
    if not PROFILE:
        yield
        return
    out = Path(PROFILE)
    with Profiler(profiled_kind, out, tag):
        yield
    for kind in ("command", "worker"):
        text = summary(sorted(out.glob(f"{tag}-{kind}-*.txt")))
        (out / f"{tag}-{kind}.summary.txt").write_text(text + "\n")
        print(f"\nprofile of {tag}, {kind} processes:\n{text}", flush=True)


def main() -> None:
    """Each engine runs alone: local first, then Dask (its row and the ceiling), stopped before Ray."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    work = Path(tempfile.mkdtemp(prefix="rf-scale-"))
    logs = work / "logs"
    logs.mkdir()
    prefect = spawn_prefect_server(home=str(work / "prefect-home"))
    env = {**os.environ, **prefect.env, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    sim = spawn_simulator("--slots", str(SLOTS), "--latency-ms", str(LATENCY_MS))
    SIMULATOR.append(sim.url)
    fast = spawn_simulator("--latency-ms", "0", "--slots", "4096")
    rows = write_input(work / "rows.jsonl", ROLLOUTS)
    common = ["run", "--input", str(rows), "--backend-kind", "agent", "--backend-url", sim.url,
              "--parallelism", str(PARALLELISM), "--chunk-size", CHUNK_SIZE, "--no-progress"]  # fmt: skip
    only = sys.argv[1].split(",") if len(sys.argv) > 1 else ["local", "dask", "ray", "ceiling"]
    results, ceiling, engine = [], None, []
    try:
        if "local" in only:  # twice, as each engine: the first run also pays the Prefect server's warm-up
            results += local_runs(common, env, work, "before Dask" if "dask" in only else "")
        if "dask" in only or "ceiling" in only:
            address, engine = dask_cluster(env, logs)
            dask = ["--runner", "dask", "--dask-address", address]
        if "dask" in only:
            # A cluster's first run pays its scheduler's and workers' first task (~1 s here); a long-lived
            # cluster pays it once, so the second run on the same workers is the usual case.
            for name, folder in (("fresh cluster", "dask"), ("second run", "dask-again")):
                args = [*common, "--output", str(work / folder), *dask]
                results.append(run(f"dask, 2 workers, {name}", args, env, work / folder)[0])
        if "ceiling" in only:
            rows24k = write_input(work / "rows24k.jsonl", 2 * ROLLOUTS)
            args = ["run", "--input", str(rows24k), "--output", str(work / "ceiling"), "--backend-kind",
                    "agent", "--backend-url", fast.url, "--parallelism", "64", "--no-progress",
                    *dask]  # fmt: skip
            ceiling = run("ceiling", args, env, work / "ceiling")[1]
        stop(engine)
        if "ray" in only:
            if "local" in only and "dask" in only:  # the machine's speed drifts: local again, beside Ray
                results += local_runs(common, env, work, "before Ray")
            ray_address, engine, ray_env = ray_cluster(env, logs)
            ray = ["--runner", "ray", "--ray-address", ray_address]
            for name, folder in (("fresh cluster", "ray"), ("second run", "ray-again")):
                args = [*common, "--output", str(work / folder), *ray]
                results.append(run(f"ray, 2 workers, {name}", args, ray_env, work / folder)[0])
            warm = [*ray, "--ray-keep-workers-s", str(RAY_KEEP_S)]
            for name, folder in (("warm workers started", "ray-warm"), ("warm workers kept", "ray-kept")):
                args = [*common, "--output", str(work / folder), *warm]
                results.append(run(f"ray, 2 workers, {name}", args, ray_env, work / folder)[0])
            stop(engine)  # a fresh cluster whose warm workers start with it, as Dask's workers do
            ray_address, engine, ray_env = ray_cluster(env, logs)
            keep = ["--ray-keep-workers-s", str(RAY_KEEP_S)]
            start_workers = [
                ROLLFLOW,
                "ray-workers",
                "--ray-address",
                ray_address,
                "--keep-s",
                str(RAY_KEEP_S),
            ]
            subprocess.run(start_workers, env=ray_env, check=True, capture_output=True, timeout=300)
            args = [*common, "--output", str(work / "ray-with-cluster"), "--runner", "ray", "--ray-address",
                    ray_address, *keep]  # fmt: skip
            name = "ray, 2 workers, warm workers started with the cluster"
            results.append(run(name, args, ray_env, work / "ray-with-cluster")[0])
    finally:
        stop(engine)
        for service in (sim, fast, prefect):
            service.stop()
    report(results, ceiling)
    shutil.rmtree(work, ignore_errors=True)


def local_runs(common: list[str], env: dict[str, str], work: Path, when: str) -> list[Row]:
    """The local runner twice, then split in two by hand (the floor of any two-process scheme here)."""
    rows = []
    for run_name in ("first run", "second run"):
        name = f"local, {run_name}" + (f", {when}" if when else "")
        folder = work / name.replace(", ", "-").replace(" ", "-")
        rows.append(run(name, [*common, "--output", str(folder)], env, folder)[0])
    rows.append(split_run(common, env, work, "split by hand" + (f", {when}" if when else "")))
    return rows


def split_run(common: list[str], env: dict[str, str], work: Path, name: str) -> Row:
    """Two local `rollflow run` processes side by side, each with half the rows at half the parallelism:
    the input split by index range across machines, as by hand. Its CPU per rollout over the local
    runner's is what splitting the same load over two processes costs on this machine, with no engine."""
    halves = [work / f"half-{i}.jsonl" for i in range(2)]
    for i, half in enumerate(halves):
        if not half.exists():  # written once, for every split run of the bench
            write_input(half, ROLLOUTS // 2, seed=i + 1)
    folders = [work / f"{name.replace(', ', '-').replace(' ', '-')}-{i}" for i in range(2)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with backend_timeline(name):
        procs = [
            subprocess.Popen(
                [ROLLFLOW, *half_of(common, half), "--output", str(folder)],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            for half, folder in zip(halves, folders, strict=True)
        ]
        errors = [proc.communicate(timeout=900)[1] for proc in procs]
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    for proc, err in zip(procs, errors, strict=True):
        if proc.returncode:
            raise SystemExit(f"{name}: exit {proc.returncode}\n{err.decode(errors='replace')[-3000:]}")
    reports = [json.loads((folder / "report.json").read_text()) for folder in folders]
    rollouts = sum(r["rows_written"] for r in reports)
    collect_s = max(r["stages"]["collect"] for r in reports)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Row(name, rollouts, collect_s, rollouts / collect_s, cpu, 0.0, 0.0)


def stop(roots: list[psutil.Process]) -> None:
    """Kill the engine's process trees, and in a pid namespace of its own, every process they left; then
    reap them. Reaped later (the next Popen reaps children it finds dead), their whole CPU time would
    join RUSAGE_CHILDREN inside the run measured then: a local run read 0.60 ms instead of 0.35 so."""
    killed = []
    for proc in roots:
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in [proc, *proc.children(recursive=True)]:
                child.kill()
                killed.append(child)
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            if engine_kind(proc) is not None:
                proc.kill()
                killed.append(proc)
    psutil.wait_procs(killed, timeout=30)
    roots.clear()


def report(results: list[Row], ceiling: dict | None) -> None:
    print(f"\n{ROLLOUTS:,} rollouts, simulator {SLOTS} slots x {LATENCY_MS:g} ms ({CAPACITY:,.0f}/s), "
          f"--parallelism {PARALLELISM}, {os.cpu_count()} cores, all on one machine\n")  # fmt: skip
    print(
        "| runner | rollouts | collect s | rollouts/s | share of capacity | CPU ms/rollout (command + "
        "workers) | engine daemons ms/rollout |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in results:
        print(row.line())
    save(
        "scale_out",
        results,
        title="Scale-out: the local runner, Dask and Ray",
        params={"rollouts": ROLLOUTS, "ceiling": ceiling},
    )
    baseline: list[Row] = []  # each engine is compared with the local runs measured just before it
    split: Row | None = None  # and with the local runner split in two by hand just before it
    after_local = False
    for row in results:
        if row.name.startswith("split"):
            split = row
            continue
        is_local = row.name.startswith("local")
        if is_local:
            baseline = [*baseline, row] if after_local else [row]
        elif baseline:
            best_rate = max(r.rate for r in baseline)
            best_cpu = min(r.cpu_per_rollout for r in baseline)
            rate, cpu = row.rate / best_rate, row.cpu_per_rollout / best_cpu
            by_hand = (
                ""
                if split is None
                else (
                    f"; {row.cpu_per_rollout / split.cpu_per_rollout:.2f}x the CPU per rollout of the "
                    f"split by hand, which is {split.cpu_per_rollout / best_cpu:.2f}x the local runner's"
                )
            )
            print(f"{row.name}: {rate:.2f} of the local runner's rate (goal >= 0.9), {cpu:.2f}x its CPU "
                  f"per rollout (goal <= 1.3); the local runs just before: {best_rate:,.0f}/s, "
                  f"{1000 * best_cpu:.2f} ms{by_hand}")  # fmt: skip
        after_local = is_local
    if ceiling is None:
        return
    print("\nzero-latency client ceiling, per Dask worker process (rollouts per CPU-second of that process):")
    for worker in ceiling["workers"]:
        per_cpu = worker["rollouts"] / worker["cpu_s"] if worker["cpu_s"] else 0.0
        cpu = worker["cpu_s"]
        print(f"  {worker['worker']}: {worker['rollouts']:,} rollouts, {cpu:.1f} CPU-s, {per_cpu:,.0f}/CPU-s")
    print(f"  collect rate of the 2 workers together: {ceiling['collect_rollouts_per_s']:,.0f} rollouts/s")


if __name__ == "__main__":
    if os.environ.get(INSIDE) == "1":
        main()
    else:
        unshare = ["unshare", "-rn", "--pid", "--fork", "--kill-child", "--mount-proc"]
        sys.exit(subprocess.call([*unshare, sys.executable, *sys.argv], env={**os.environ, INSIDE: "1"}))
