"""A run's fixed cost: `rollflow --help`, and a 10-row collect with each kind of Prefect server.

Rows (one run each, wall time and CPU-s of the command and every process it waited for): `--help`; with no
PREFECT_API_URL, `keep` starting the lasting server in a fresh PREFECT_HOME (Prefect creates its database
too), `keep` reusing it, `ephemeral` (Prefect's temporary server, database present), `keep` starting the
server again with the database present; and a running `prefect server` (PREFECT_API_URL set).
Goals from issue 11: --help under 0.5 s, ephemeral under 5 s, running server under 2 s.
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

from rollflow.infra.local import free_port

EXE = str(Path(sys.executable).with_name("rollflow"))
PREFECT = str(Path(sys.executable).with_name("prefect"))


def timed(args: list[str], env: dict[str, str], exe: str | None = EXE) -> tuple[float, float, int]:
    """Whole-command wall time and CPU-s (the command and every process it waited for)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([exe, *args] if exe else args, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode:
        print(proc.stderr[-2000:], file=sys.stderr)
    return wall, cpu, proc.returncode


def _server_cpu_s(home: Path) -> float | None:
    """CPU-s so far of the kept server (not the command's child, so not in its row), from /proc."""
    try:
        stat = Path(f"/proc/{int((home / 'server.pid').read_text())}/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _stop_kept(env: dict[str, str]) -> None:
    subprocess.run([PREFECT, "server", "stop"], env=env, capture_output=True, timeout=120)


def _local_rows(base: dict[str, str], tmp: str, inp: Path, url: str) -> list[tuple[str, tuple]]:
    home = Path(tmp) / "home"
    local = {**base, "PREFECT_HOME": str(home), "PREFECT_SERVER_API_PORT": str(free_port())}
    keep, eph = (
        {**local, "ROLLFLOW_PREFECT__LOCAL_SERVER": "keep"},
        {**local, "ROLLFLOW_PREFECT__LOCAL_SERVER": "ephemeral"},
    )
    rows = []

    def collect(name: str, env: dict[str, str]) -> None:
        out = f"{tmp}/out{len(rows)}"
        rows.append((name, timed(["collect", "--input", str(inp), "--output", out, *_flags(url)], env)))

    try:
        collect("keep: starts the server (new PREFECT_HOME)", keep)
        started_cpu = _server_cpu_s(home)
        collect("keep: reuses the running server", keep)
        _stop_kept(local)
        collect("ephemeral Prefect server", eph)
        collect("keep: starts the server (database exists)", keep)
    finally:
        _stop_kept(local)
    if started_cpu is not None:
        print(f"the kept server's own start-up: {started_cpu:.2f} CPU-s (not in the rows)", file=sys.stderr)
    return rows


def main() -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ROLLFLOW_", "PREFECT_API_URL"))}
    base["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    sim = spawn_simulator("--latency-ms", "0", "--slots", "256")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            inp = write_input(Path(tmp) / "in.jsonl", 10)
            rows = [("rollflow --help", timed(["--help"], base))]
            rows += _local_rows(base, tmp, inp, sim.url)
            prefect = spawn_prefect_server()
            try:
                args = ["collect", "--input", str(inp), "--output", f"{tmp}/running", *_flags(sim.url)]
                rows.append(
                    ("running prefect server (PREFECT_API_URL)", timed(args, {**base, **prefect.env}))
                )
            finally:
                prefect.stop()
    finally:
        sim.stop()
    print(f"{'10-row collect, Prefect server':44} {'wall s':>7} {'CPU s':>7}")
    for name, (wall, cpu, rc) in rows:
        print(f"{name:44} {wall:7.2f} {cpu:7.2f}" + ("" if rc == 0 else f"  (exit {rc})"))
    table = [
        {"command": n, "wall s": round(w, 2), "CPU s": round(c, 2), "exit": rc} for n, (w, c, rc) in rows
    ]
    save("startup", table, title="Start-up: `rollflow --help` and a 10-row collect per Prefect server")


def _flags(url: str) -> list[str]:
    return ["--backend-kind", "agent", "--backend-url", url, "--parallelism", "8", "--no-progress"]


if __name__ == "__main__":
    main()
