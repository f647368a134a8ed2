"""A run's fixed cost: `rollflow --help`, and a 10-row collect in ephemeral mode and with a running server.

Prints figures (one run each); goals from issue 11: under 0.5 s, 5 s and 2 s.
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

EXE = str(Path(sys.executable).with_name("rollflow"))


def timed(args: list[str], env: dict[str, str], exe: str | None = EXE) -> tuple[float, float, int]:
    """Whole-command wall time and CPU-s (the command and every process it waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([exe, *args] if exe else args, env=env, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode:
        print(proc.stderr[-2000:], file=sys.stderr)
    return wall, cpu, proc.returncode


def main() -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLFLOW_", "PREFECT_API_URL"))}
    base["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    sim = spawn_simulator("--latency-ms", "0", "--slots", "256")
    prefect = spawn_prefect_server()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            inp = write_input(Path(tmp) / "in.jsonl", 10)
            home = Path(tmp) / "home"  # a fresh PREFECT_HOME whose server port nobody listens on
            eph = {**base, "PREFECT_HOME": str(home), "PREFECT_SERVER_API_PORT": "1"}
            timed(["collect", "--input", str(inp), "--output", f"{tmp}/warm", *_flags(sim.url)], eph)
            rows = [("rollflow --help", timed(["--help"], base))]
            for name, env in (
                ("10-row collect, ephemeral Prefect", eph),
                ("10-row collect, running prefect server", {**base, **prefect.env}),
            ):
                rows.append((name, timed(["collect", "--input", str(inp), "--output", f"{tmp}/{len(rows)}",
                                          *_flags(sim.url)], env)))  # fmt: skip
    finally:
        prefect.stop()
        sim.stop()
    print(f"{'command':42} {'wall s':>7} {'CPU s':>7}")
    for name, (wall, cpu, rc) in rows:
        print(f"{name:42} {wall:7.2f} {cpu:7.2f}" + ("" if rc == 0 else f"  (exit {rc})"))


def _flags(url: str) -> list[str]:
    return ["--backend-kind", "agent", "--backend-url", url, "--parallelism", "8", "--no-progress"]


if __name__ == "__main__":
    main()
