"""Client ceiling: how fast can rollflow drive a backend that answers instantly?

Simulator with zero latency and 4096 slots, 20,000 rollouts (10,000 rows x 2) at parallelism 256.
Prints collection rollouts/s, client CPU per rollout (the rollflow process only) and start-up time.
Goal: >= 3,000 rollouts/s and < 0.4 ms CPU per rollout (NeMo Gym's collector: ~2,900/s, ~0.55 ms).
`--profile DIR`: py-spy on the command (its raw stacks go to DIR) and the top functions of its collect stage.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from pathlib import Path

import psutil
from harness import run_args, run_rollflow, spawn_prefect_server, spawn_simulator, write_input
from pyspy import Profiler, rollflow_command, summary
from results import save

# The collect stage in a profile: the chunks, their rollouts' workers, the I/O callbacks of their requests.
COLLECT_STAGE = (
    "collect_stage",
    "collect_chunk",
    "run_rollouts",
    "_read_ready",
    "ClientRequest.write_bytes",
    "Ledger.commit",
)


def own_command(proc: psutil.Process) -> str | None:
    """This bench's `rollflow run` only: the machine may run others at the same time."""
    return rollflow_command(proc) if proc.ppid() == os.getpid() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--parallelism", type=int, default=256)
    ap.add_argument("--kind", default="agent", choices=["agent", "responses", "chat"])
    ap.add_argument("--profile", type=Path, default=None, help="a folder: py-spy profile of the command")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rollflow-bench-"))
    inp = write_input(work / "input.jsonl", args.rows)
    sim = spawn_simulator("--latency-ms", "0", "--slots", "4096")
    prefect = spawn_prefect_server()
    spy = (
        Profiler(own_command, args.profile, "ceiling", rate=200) if args.profile else contextlib.nullcontext()
    )
    try:
        with spy:
            res = run_rollflow(
                run_args(
                    str(inp),
                    sim.url,
                    parallelism=args.parallelism,
                    repeats=args.repeats,
                    kind=args.kind,
                    extra=("--verifier", "exact_match"),
                ),
                prefect.env,
                work / "out",
            )
    finally:
        sim.stop()
        prefect.stop()
    if args.profile:
        text = summary(sorted(args.profile.glob("ceiling-command-*.txt")), within=COLLECT_STAGE, top=40)
        (args.profile / "collect.summary.txt").write_text(text + "\n")
        print(f"profile of the collect stage (py-spy, the rollflow process):\n{text}")
    rep = res.report
    m = rep["metrics"]
    cpu_us = m["collect_cpu_s"] / m["collected"] * 1e6
    print(f"client ceiling ({args.kind}, parallelism {args.parallelism}, {m['collected']:,} rollouts)")
    print(f"  exit status            {res.returncode}")
    print(f"  rollouts/s (collect)   {rep['collect_rollouts_per_s']:,.0f}    goal >= 3,000")
    print(f"  client CPU / rollout   {cpu_us:,.0f} us    goal < 400 us")
    print(f"  collect wall           {m['collect_s']:.2f} s")
    print(f"  whole command wall     {res.wall_s:.2f} s (start-up, plan, verify, publish included)")
    print(f"  peak RSS               {m['peak_rss_mb']:.0f} MB")
    figures = {
        "exit": res.returncode,
        "rollouts": m["collected"],
        "rollouts/s (collect)": round(rep["collect_rollouts_per_s"]),
        "client CPU µs/rollout": round(cpu_us),
        "collect s": round(m["collect_s"], 2),
        "whole command s": round(res.wall_s, 2),
        "peak RSS MB": round(m["peak_rss_mb"]),
    }
    if args.profile:  # a profiled run's figures carry py-spy's cost: shown, not saved
        return
    save(
        "client_ceiling",
        [figures],
        title="Client ceiling: a backend that answers instantly",
        params={k: v for k, v in vars(args).items() if k != "profile"},
        goal=">= 3,000 rollouts/s and < 400 µs client CPU per rollout",
    )


if __name__ == "__main__":
    main()
