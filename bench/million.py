"""A million rollouts against the zero-latency simulator: peak RSS must not grow with rows; Prefect overhead.

Runs 100,000 and 1,000,000 rollouts (rows x repeats) and prints, for each: rollouts/s, peak RSS of the
rollflow process, and the share of chunk-task time spent in Prefect's task machinery (goal under 2%).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from harness import run_args, run_rollflow, spawn_prefect_server, spawn_simulator, write_input
from results import save


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000], help="rollouts per run")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--chunk-size", type=int, default=2500)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rollflow-million-"))
    sim = spawn_simulator("--latency-ms", "0", "--slots", "4096", "--max-tokens", "64")
    prefect = spawn_prefect_server()
    table: list[dict[str, object]] = []
    print(
        f"  {'rollouts':>9}  {'rollouts/s':>10}  {'peak RSS MB':>11}  {'prefect share':>13}  {'wall s':>7}"
        "  exit"
    )
    try:
        for size in args.sizes:
            rows = size // args.repeats
            inp = write_input(work / f"in-{size}.jsonl", rows)
            res = run_rollflow(
                run_args(
                    str(inp),
                    sim.url,
                    parallelism=256,
                    repeats=args.repeats,
                    extra=("--chunk-size", str(args.chunk_size)),
                ),
                prefect.env,
                work / f"out-{size}",
                timeout_s=3600,
            )
            m = res.report["metrics"]
            share = m["prefect_overhead_share"]
            print(
                f"  {size:>9,}  {res.report['collect_rollouts_per_s']:>10,.0f}  {m['peak_rss_mb']:>11,.1f}  "
                f"{share:>13.2%}  {res.wall_s:>7.1f}  {res.returncode}",
                flush=True,
            )
            table.append(
                {
                    "rollouts": size,
                    "rollouts/s": round(res.report["collect_rollouts_per_s"]),
                    "peak RSS MB": round(m["peak_rss_mb"], 1),
                    "Prefect share": round(share, 4),
                    "wall s": round(res.wall_s, 1),
                    "exit": res.returncode,
                }
            )
            (work / f"out-{size}" / "rollouts.jsonl").unlink(missing_ok=True)
            inp.unlink()
    finally:
        sim.stop()
        prefect.stop()
    print("  goals: peak RSS flat in rows; Prefect share under 2%")
    save(
        "million",
        table,
        title="A million rollouts",
        params=vars(args),
        goal="peak RSS flat in rows; Prefect share under 2%",
    )


if __name__ == "__main__":
    main()
