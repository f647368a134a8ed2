"""What the kept local Prefect server costs while idle: CPU-s per minute of its processes, with every
Prefect service on and with the services rollflow leaves off (`SERVICES_OFF`), side by side in one run.

Each server is started the way a run starts it (`LocalServer`, a fresh PREFECT_HOME), left to settle, then
measured over `--window` seconds of idleness; the two alternate for `--rounds` rounds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from results import save

from rollflow.flows.cli import local_server
from rollflow.flows.cli.local_server import SERVICES_OFF, LocalServer
from rollflow.infra.local import free_port


def _tree_cpu(pid: int) -> float:
    """CPU-s used so far by the server process and its children."""
    root = psutil.Process(pid)
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def idle_cpu_per_min(services_off: dict[str, str], settle_s: float, window_s: float) -> float:
    home = Path(tempfile.mkdtemp(prefix="rollflow-bench-idle-"))
    server = LocalServer(home, free_port(), services_off)
    server.start()
    try:
        server.wait(180)
        pid = int((home / local_server.PID_FILE).read_text().strip())
        time.sleep(settle_s)
        c0, t0 = _tree_cpu(pid), time.monotonic()
        time.sleep(window_s)
        return 60 * (_tree_cpu(pid) - c0) / (time.monotonic() - t0)
    finally:
        env = {"PREFECT_HOME": str(home), "PATH": str(Path(sys.executable).parent)}
        subprocess.run([str(Path(sys.executable).with_name("prefect")), "server", "stop"], env=env,
                       capture_output=True, timeout=60)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=float, default=60.0, help="seconds of idleness measured")
    ap.add_argument("--settle", type=float, default=15.0, help="seconds after it answers, before measuring")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    ours = dict(SERVICES_OFF)
    got: dict[str, list[float]] = {"every service on": [], "rollflow's services": []}
    for _ in range(args.rounds):
        got["every service on"].append(idle_cpu_per_min({}, args.settle, args.window))
        got["rollflow's services"].append(idle_cpu_per_min(ours, args.settle, args.window))
    rows = []
    for name, values in got.items():
        row = {"server": name, "idle_cpu_s_per_min": round(statistics.median(values), 2),
               "each_round": [round(v, 2) for v in values]}  # fmt: skip
        rows.append(row)
        print(f"  {name:<22} idle CPU {row['idle_cpu_s_per_min']:5.2f} s/min (rounds {row['each_round']})")
    ratio = rows[1]["idle_cpu_s_per_min"] / rows[0]["idle_cpu_s_per_min"]
    print(f"  rollflow's services / every service on: {ratio:.2f}")
    rows.append({"server": "ratio", "idle_cpu_s_per_min": round(ratio, 2)})
    save("server_idle", rows, title="The kept Prefect server's idle CPU", params=vars(args),
         goal="less idle CPU than a server with every Prefect service on")  # fmt: skip


if __name__ == "__main__":
    main()
