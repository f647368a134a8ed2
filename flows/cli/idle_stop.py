"""The kept local server's idle stop: a small watcher process, started with the server, that stops it once
nothing has used it for ROLLFLOW_PREFECT__IDLE_STOP_S (an idle server still burns part of a core).

Used means: a flow run running, pending or cancelling, or a served deployment whose runner polls it
(`rollflow serve` against this server). The watcher ends with the server, however the server ends; a later
run starts both again. Run as `python -m rollflow.flows.cli.idle_stop HOME API_URL IDLE_S`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

WATCHER_PID_FILE = "rollflow-idle-stop.pid"
BUSY_STATES = ["RUNNING", "PENDING", "CANCELLING"]
REQUEST_TIMEOUT_S = 10.0
STARTING_S = 600.0


def start_watcher(home: Path, api_url: str, idle_s: float) -> None:
    """Start the watcher beside a server this command started (none when idle_s is 0: never stop)."""
    if idle_s <= 0 or _alive(home / WATCHER_PID_FILE):
        return
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollflow.flows.cli.idle_stop", str(home), api_url, repr(float(idle_s))],
        env={**os.environ, "PREFECT_HOME": str(home)},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # Ctrl-C on the run that started it never reaches it
    )
    (home / WATCHER_PID_FILE).write_text(str(proc.pid))


def _alive(pid_file: Path) -> bool:
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    try:
        return b"idle_stop" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True


def _post(api_url: str, path: str, body: dict) -> object:
    request = urllib.request.Request(
        f"{api_url.rstrip('/')}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as resp:
        return json.loads(resp.read())


def in_use(api_url: str) -> bool:
    """Whether a flow run is under way or a runner serves a deployment here (Prefect marks a deployment
    READY while its runner polls)."""
    runs = _post(api_url, "/flow_runs/count", {"flow_runs": {"state": {"type": {"any_": BUSY_STATES}}}})
    deployments = _post(api_url, "/deployments/filter", {"limit": 200})
    served = any(d.get("status") == "READY" for d in deployments) if isinstance(deployments, list) else False
    return bool(runs) or served


def watch(home: Path, api_url: str, idle_s: float, poll_s: float | None = None) -> str:
    """Until the server ends or has been idle `idle_s`; then stop it. Returns why the watch ended."""
    poll_s = poll_s or min(60.0, max(1.0, idle_s / 10))
    pid_file = home / "server.pid"
    appears = time.monotonic() + STARTING_S  # Prefect writes it once it has spawned the server
    while not pid_file.exists():
        if time.monotonic() > appears:
            return "the server did not start"
        time.sleep(0.5)
    last_used = time.monotonic()
    while True:
        time.sleep(poll_s)
        if not pid_file.exists():
            return "the server stopped"
        try:
            if in_use(api_url):
                last_used = time.monotonic()
                continue
        except (OSError, urllib.error.URLError, ValueError):
            last_used = time.monotonic()  # a server that does not answer now is starting or busy
            continue
        if time.monotonic() - last_used >= idle_s:
            prefect = Path(sys.executable).with_name("prefect")
            subprocess.run(
                [str(prefect), "server", "stop"],
                env={**os.environ, "PREFECT_HOME": str(home)},
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=120,
            )
            return f"stopped after {idle_s:g} s idle"


def main(argv: list[str]) -> int:
    home, api_url, idle_s = Path(argv[0]), argv[1], float(argv[2])
    try:
        watch(home, api_url, idle_s)
    finally:
        (home / WATCHER_PID_FILE).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
