"""What one backend's load costs a client split over two processes, with no engine: the local runner's
CPU per rollout above its fixed cost, one process at --parallelism 32 against two side by side at 16
(half the rows each), and one alone at 16 (half the rows).

The simulator runs at 32 slots x 50 ms (640 rollouts/s). A run's fixed cost (imports, the Prefect flow
run, the report) is a 64-row run's CPU, measured again each round; a run's marginal CPU is its command's
CPU (RUSAGE_CHILDREN) less that, per rollout. Rounds alternate the three, as this machine drifts.

    python bench/split_floor.py          # 3 rounds of 12,000 rollouts
    ROLLFLOW_BENCH_ROUNDS=1 ROLLFLOW_BENCH_ROLLOUTS=6000 python bench/split_floor.py
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import spawn_prefect_server, spawn_simulator, write_input
from results import save

ROLLOUTS = int(os.environ.get("ROLLFLOW_BENCH_ROLLOUTS", "12000"))
ROUNDS = int(os.environ.get("ROLLFLOW_BENCH_ROUNDS", "3"))
FIXED_ROWS = 64
ROLLFLOW = str(Path(sys.executable).parent / "rollflow")


def runs(specs: list[tuple[Path, int]], url: str, env: dict[str, str], work: Path) -> tuple[float, float]:
    """`rollflow run` for each (input, parallelism) side by side: their CPU seconds together, wall seconds."""
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    procs = []
    for i, (rows, parallelism) in enumerate(specs):
        cmd = [ROLLFLOW, "run", "--input", str(rows), "--output", str(work / f"out-{time.time_ns()}-{i}"),
               "--backend-kind", "agent", "--backend-url", url, "--parallelism", str(parallelism),
               "--no-progress"]  # fmt: skip
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for proc in procs:
        _, err = proc.communicate(timeout=900)
        if proc.returncode:
            raise SystemExit(f"rollflow run: exit {proc.returncode}\n{err.decode(errors='replace')[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, time.perf_counter() - t0


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="rf-split-"))
    prefect = spawn_prefect_server(home=str(work / "prefect-home"))
    env = {**os.environ, **prefect.env, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    sim = spawn_simulator("--slots", "32", "--latency-ms", "50")
    small = write_input(work / "small.jsonl", FIXED_ROWS)
    whole = write_input(work / "whole.jsonl", ROLLOUTS)
    halves = [write_input(work / f"half-{i}.jsonl", ROLLOUTS // 2, seed=i + 1) for i in range(2)]
    print(f"{ROLLOUTS:,} rollouts, simulator 32 slots x 50 ms; marginal CPU ms per rollout above a "
          f"{FIXED_ROWS}-row run's\n")  # fmt: skip
    print("| round | fixed CPU-s | one at 32 | two at 16, side by side | one at 16 |")
    print("|---|---:|---:|---:|---:|")
    table: list[dict[str, object]] = []
    try:
        runs([(small, 32)], sim.url, env, work)  # the Prefect server's warm-up
        for rnd in range(1, ROUNDS + 1):
            fixed = runs([(small, 32)], sim.url, env, work)[0]
            one = (runs([(whole, 32)], sim.url, env, work)[0] - fixed) / ROLLOUTS
            two = (runs([(h, 16) for h in halves], sim.url, env, work)[0] - 2 * fixed) / ROLLOUTS
            half = (runs([(halves[0], 16)], sim.url, env, work)[0] - fixed) / (ROLLOUTS // 2)
            print(f"| {rnd} | {fixed:.2f} | {1000 * one:.3f} | {1000 * two:.3f} ({two / one:.2f}x) | "
                  f"{1000 * half:.3f} ({half / one:.2f}x) |", flush=True)  # fmt: skip
            table.append(
                {
                    "round": rnd,
                    "fixed CPU-s": round(fixed, 2),
                    "one at 32 ms": round(1000 * one, 3),
                    "two at 16 ms": round(1000 * two, 3),
                    "one at 16 ms": round(1000 * half, 3),
                }
            )
    finally:
        sim.stop()
        prefect.stop()
    save(
        "split_floor",
        table,
        title="The split by hand: CPU per rollout above a run's fixed cost",
        params={"rollouts": ROLLOUTS},
    )


if __name__ == "__main__":
    main()
