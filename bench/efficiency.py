"""Efficiency: achieved rollouts/s as a fraction of a backend's capacity.

Simulator with 64 slots x 100 ms (capacity 640 rollouts/s); rollflow at parallelism 64 and 128, with a
constant service time and with +-20% jitter (same mean, same capacity). A constant service time is the
worst case for a closed loop at parallelism == slots: all 64 requests finish in one wave, and the time
client and server spend on that wave's bodies is capacity lost each cycle. Goal: >= 0.95 of capacity.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from harness import run_args, run_rollflow, spawn_prefect_server, spawn_simulator, write_input
from results import save


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=4_000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--latency-ms", type=float, default=100.0)
    ap.add_argument("--jitters", type=float, nargs="+", default=[0.0, 0.2])
    args = ap.parse_args()
    capacity = args.slots * 1000.0 / args.latency_ms
    work = Path(tempfile.mkdtemp(prefix="rollflow-bench-"))
    inp = write_input(work / "input.jsonl", args.rows)
    prefect = spawn_prefect_server()
    table: list[dict[str, object]] = []
    print(f"efficiency: simulator {args.slots} slots x {args.latency_ms:.0f} ms = capacity {capacity:,.0f}/s")
    print(
        f"  {'jitter':>6}  {'parallelism':>11}  {'rollouts':>8}  {'rollouts/s':>10}  {'of capacity':>11}"
        "  exit"
    )
    try:
        for jitter in args.jitters:
            sim = spawn_simulator(
                "--latency-ms", str(args.latency_ms), "--slots", str(args.slots), "--jitter", str(jitter)
            )
            try:
                for parallelism in (args.slots, 2 * args.slots):
                    res = run_rollflow(
                        run_args(str(inp), sim.url, parallelism=parallelism, repeats=args.repeats),
                        prefect.env,
                        work / f"out-{jitter}-{parallelism}",
                    )
                    rate = res.report["collect_rollouts_per_s"]
                    collected = res.report["metrics"]["collected"]
                    print(
                        f"  {jitter:>6.0%}  {parallelism:>11}  {collected:>8,}  {rate:>10,.1f}  "
                        f"{rate / capacity:>11.3f}  {res.returncode}"
                    )
                    table.append(
                        {
                            "jitter": jitter,
                            "parallelism": parallelism,
                            "rollouts": collected,
                            "rollouts/s": round(rate, 1),
                            "of capacity": round(rate / capacity, 3),
                            "exit": res.returncode,
                        }
                    )
            finally:
                sim.stop()
    finally:
        prefect.stop()
    print("  goal: >= 0.95 of capacity")
    save(
        "efficiency",
        table,
        title=f"Efficiency: {args.slots} slots x {args.latency_ms:g} ms",
        params={**vars(args), "capacity": capacity},
        goal=">= 0.95 of capacity",
    )


if __name__ == "__main__":
    main()
