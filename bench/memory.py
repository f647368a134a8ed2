"""Memory: peak RSS of the rollflow process must not grow with the number of rows.

Zero-latency simulator; 20,000 and 200,000 rows (1 rollout each); the process reports its own peak RSS.
Goal: the two peaks differ by under 20% (NeMo Gym's collector holds every row: 338 MB at 5,000 rollouts).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from harness import run_args, run_rollflow, spawn_prefect_server, spawn_simulator, write_input
from results import save


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[20_000, 200_000])
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rollflow-bench-"))
    sim = spawn_simulator("--latency-ms", "0", "--slots", "4096")
    prefect = spawn_prefect_server()
    peaks: list[float] = []
    table: list[dict[str, object]] = []
    print(f"  {'rows':>9}  {'peak RSS MB':>11}  {'rollouts/s':>10}  {'wall s':>7}  exit")
    try:
        for rows in args.sizes:
            inp = write_input(work / f"input-{rows}.jsonl", rows)
            res = run_rollflow(
                run_args(str(inp), sim.url, parallelism=256),
                prefect.env,
                work / f"out-{rows}",
                timeout_s=1800,
            )
            peak = res.report["metrics"]["peak_rss_mb"]
            peaks.append(peak)
            print(
                f"  {rows:>9,}  {peak:>11,.1f}  {res.report['collect_rollouts_per_s']:>10,.0f}  "
                f"{res.wall_s:>7.1f}  {res.returncode}"
            )
            table.append(
                {
                    "rows": rows,
                    "peak RSS MB": round(peak, 1),
                    "wall s": round(res.wall_s, 1),
                    "rollouts/s": round(res.report["collect_rollouts_per_s"]),
                    "exit": res.returncode,
                }
            )
    finally:
        sim.stop()
        prefect.stop()
    growth = (max(peaks) - min(peaks)) / min(peaks)
    print(f"  peak RSS difference {growth:.1%}    goal < 20%")
    save(
        "memory",
        table,
        title="Memory: peak RSS against the size of the run",
        params={**vars(args), "peak RSS difference": round(growth, 3)},
        goal="peak RSS difference < 20%",
    )


if __name__ == "__main__":
    main()
