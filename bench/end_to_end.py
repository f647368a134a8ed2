"""20,000 rollouts end to end: zero-latency simulator in agent mode (its own process), parallelism 256.

Prints the whole command's wall time, rollouts/s and CPU-s (the command and every process it waited for,
from RUSAGE_CHILDREN), ephemeral Prefect and with a running `prefect server`. NeMo Gym's
`ng_collect_rollouts` runs beside it only when NG_COLLECT_CMD gives a full command line for the same
input (it resolves its agent through NeMo Gym's head server, which this benchmark does not start).
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
from pathlib import Path

from harness import spawn_prefect_server, spawn_simulator, write_input
from startup import timed

ROLLOUTS, PARALLELISM = 20_000, 256


def main() -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLFLOW_", "PREFECT_API_URL"))}
    base["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    sim = spawn_simulator("--latency-ms", "0", "--slots", "4096")
    prefect = spawn_prefect_server()
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            inp = write_input(Path(tmp) / "in.jsonl", ROLLOUTS)
            eph = {**base, "PREFECT_HOME": f"{tmp}/home", "PREFECT_SERVER_API_PORT": "1"}
            args = ["collect", "--input", str(inp), "--backend-kind", "agent", "--backend-url", sim.url,
                    "--parallelism", str(PARALLELISM), "--no-progress"]  # fmt: skip
            timed(
                ["collect", "--input", str(inp), "--output", f"{tmp}/warm", "--limit", "10", *args[3:]], eph
            )
            for name, env in (
                ("rollflow, ephemeral Prefect", eph),
                ("rollflow, running server", {**base, **prefect.env}),
            ):
                rows.append((name, timed([*args, "--output", f"{tmp}/{len(rows)}"], env)))  # fmt: skip
            ng = os.environ.get("NG_COLLECT_CMD")
            if ng:
                rows.append(("NeMo Gym ng_collect_rollouts", timed(shlex.split(ng), base, exe=None)))
            else:
                print("NeMo Gym row skipped: set NG_COLLECT_CMD to its command line (needs ng_run's head "
                      "server pointing at the simulator)", file=sys.stderr)  # fmt: skip
    finally:
        prefect.stop()
        sim.stop()
    print(f"{'collector':32} {'wall s':>7} {'rollouts/s':>10} {'CPU s':>7} {'CPU ms/rollout':>14}")
    for name, (wall, cpu, rc) in rows:
        line = f"{name:32} {wall:7.2f} {ROLLOUTS / wall:10,.0f} {cpu:7.2f} {cpu * 1000 / ROLLOUTS:14.3f}"
        print(line + ("" if rc == 0 else f"  (exit {rc})"))


if __name__ == "__main__":
    main()
