"""Collector processes: one against N on the same backend, and what `--collectors auto` chooses here.

The zero-latency agent simulator, 20,000 rollouts (5,000 rows x 4) at parallelism 256, with `--collectors
1` and `--collectors N` alternating for `--rounds` rounds against one running Prefect server; then one
`--parallelism auto` run against the same simulator without engine gauges (so it tunes), whose
report.json says how many collectors `auto` chose and why. More than one pays only where cores are idle
while the client is at a core: on a machine whose other cores run the backend, `auto` keeps one.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from harness import run_args, run_rollflow, spawn_prefect_server, spawn_simulator, write_input
from results import save


def _row(label: str, res: Any) -> dict[str, Any]:
    rep = res.report
    m = rep.get("metrics") or {}
    collectors = rep.get("collectors") or {}
    return {
        "run": label,
        "exit": res.returncode,
        "collectors": collectors.get("count"),
        "rollouts written": rep.get("rows_written"),
        "rollouts/s (collect)": round(rep.get("collect_rollouts_per_s") or 0),
        "collect s": round(m.get("collect_s") or 0, 2),
        "whole command s": round(res.wall_s, 2),
        "why": collectors.get("why"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=5_000)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--parallelism", type=int, default=256)
    ap.add_argument("--collectors", type=int, default=2, help="N, set against 1")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rollflow-bench-"))
    inp = write_input(work / "input.jsonl", args.rows)
    prefect = spawn_prefect_server()
    rows: list[dict[str, Any]] = []
    try:
        sim = spawn_simulator("--latency-ms", "0", "--slots", "4096")
        try:
            for _ in range(args.rounds):
                for n in (1, args.collectors):
                    extra = ("--collectors", str(n), "--restart")
                    cmd = run_args(
                        inp, sim.url, parallelism=args.parallelism, repeats=args.repeats, extra=extra
                    )
                    rows.append(_row(f"--collectors {n}", run_rollflow(cmd, prefect.env, work / f"out-{n}")))
                    print(rows[-1], flush=True)
        finally:
            sim.stop()
        blind = spawn_simulator("--latency-ms", "0", "--slots", "4096", "--metrics-format", "none")
        try:
            cmd = run_args(inp, blind.url, parallelism="auto", repeats=args.repeats, extra=("--restart",))
            rows.append(_row("--collectors auto (tuned)", run_rollflow(cmd, prefect.env, work / "out-auto")))
            print(rows[-1], flush=True)
        finally:
            blind.stop()
    finally:
        prefect.stop()
    one = [r["rollouts/s (collect)"] for r in rows if r["run"] == "--collectors 1"]
    many = [r["rollouts/s (collect)"] for r in rows if r["run"] == f"--collectors {args.collectors}"]
    if one and many and min(one) > 0:
        print(f"{args.collectors} collectors against 1: {sum(many) / sum(one):.2f}x the collect rate")
    save(
        "collectors",
        rows,
        title="Collector processes: one against N, and what auto chooses",
        params=vars(args),
        goal="more than one only where cores are idle while the client is at a core",
    )


if __name__ == "__main__":
    main()
