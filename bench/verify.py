"""Verification at the speed of every core: rollouts/s with checks in the collecting process versus the
verifier pool, from a zero-latency simulator (so verification is what limits the run).

Two verifiers: `--verifier math` (math-verify, SymPy) and a `module:function` doing about 2 ms of pure
Python per check (bench/busy_verifier.py). Each runs with `--verify-processes 0` (a thread of the
collecting process, as before the pool) and with the pool at its default size for this machine.
Goal: the pool at least 1.7x the single process.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from harness import run_args, run_rollflow, spawn_prefect_server, spawn_simulator, write_input
from results import save

from rollflow.tasks.verify.pool import default_processes

VERIFIERS = {"math": "math", "busy 2 ms": "busy_verifier:score"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--parallelism", type=int, default=64)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rollflow-bench-verify-"))
    inp = write_input(work / "input.jsonl", args.rows)
    pool = default_processes()
    prefect = spawn_prefect_server()
    sim = spawn_simulator("--latency-ms", "0", "--slots", "4096")
    env = {
        **prefect.env,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    print(
        f"verify: {args.rows:,} rollouts, zero-latency simulator, parallelism {args.parallelism}, "
        f"{os.cpu_count()} cores, default pool {pool} processes"
    )
    table: list[dict[str, object]] = []
    print(f"  {'verifier':<10}  {'processes':>9}  {'rollouts/s':>10}  {'wall s':>7}  {'speed-up':>8}  exit")
    try:
        for label, verifier in VERIFIERS.items():
            base = None
            for processes in (0, pool):
                extra = ("--verifier", verifier, "--verify-processes", str(processes))
                res = run_rollflow(
                    run_args(str(inp), sim.url, parallelism=args.parallelism, kind="responses", extra=extra),
                    env,
                    work / f"out-{label.split()[0]}-{processes}",
                )
                rate = res.report.get("collect_rollouts_per_s", 0.0)
                base = base or rate
                shown = "thread" if processes == 0 else str(processes)
                print(
                    f"  {label:<10}  {shown:>9}  {rate:>10,.0f}  {res.wall_s:>7.1f}  "
                    f"{rate / base if base else 0:>7.2f}x  {res.returncode}"
                )
                table.append(
                    {
                        "verifier": label,
                        "processes": shown,
                        "rollouts/s": round(rate),
                        "wall s": round(res.wall_s, 1),
                        "speed-up": round(rate / base if base else 0, 2),
                        "exit": res.returncode,
                    }
                )
    finally:
        sim.stop()
        prefect.stop()
    print("  goal: the pool at least 1.7x the single process")
    save(
        "verify",
        table,
        title="Verification: checks in a thread against the process pool",
        params={**vars(args), "pool": pool},
        goal="the pool at least 1.7x the single process",
    )


if __name__ == "__main__":
    main()
