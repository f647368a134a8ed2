"""A lasting local Prefect server, started through Prefect's own `prefect server start --background`.

It listens on 127.0.0.1 at the profile's port with its PID file in PREFECT_HOME, so `prefect server stop`
stops it and every later run finds it there: those runs cost what a running server costs, and all of them
stay in its UI. The command starts in its own session, so Ctrl-C on a run never stops the server.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HEALTH_TIMEOUT_S = 0.3
POLL_S = 0.1
PID_FILE = "server.pid"  # prefect.cli._server_utils.SERVER_PID_FILE_NAME, where `prefect server stop` looks
PORT_FILE = "rollflow-server.port"  # the port rollflow started this PREFECT_HOME's server on
# Prefect services the kept server leaves off: rollflow uses no automations (triggers), work pools
# (foreman), pauses, or concurrency leases (repossessor). It keeps the scheduler (served schedules), late
# runs, cancellation, and the event and task-run recorders the UI shows runs from. An idle server's
# loops cost part of a core for as long as it lives (bench/server_idle.py measures it).
SERVICES_OFF = {
    f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false"
    for name in ("TRIGGERS", "FOREMAN", "PAUSE_EXPIRATIONS", "REPOSSESSOR")
}


class LocalServerError(Exception):
    """The local Prefect server this command started (or found starting) did not come up."""


def answers(api_url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> bool:
    """True when a Prefect API answers its health check at `api_url` (loopback, so quickly either way)."""
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/health", timeout=timeout_s) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


STARTING_GRACE_S = 30.0  # Prefect creates the PID file empty, then writes the PID once the server is spawned


def _pid_alive(pid_file: Path) -> bool:
    """Whether the server the PID file names lives (an empty file just created counts as starting)."""
    try:
        text = pid_file.read_text().strip()
        if not text:
            return time.time() - pid_file.stat().st_mtime < STARTING_GRACE_S
        os.kill(int(text), 0)
    except (OSError, ValueError):
        return False
    return _runs_prefect(int(text))


def _runs_prefect(pid: int) -> bool:
    """Whether the live process is a Prefect server, not another that took a reused PID (after a reboot)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # no /proc (not Linux): the PID alone, as before
        return True
    # empty while the process is still being started (exec not done): it cannot be told yet
    return not cmdline or b"prefect" in cmdline or b"uvicorn" in cmdline


def owned_port(home: Path, default: int) -> int | None:
    """The port of this PREFECT_HOME's own kept server: one whose PID file there names a live process (on
    the port rollflow recorded, else the profile's). Never a server that merely answers on a port."""
    if not (home / PID_FILE).exists() or not _pid_alive(home / PID_FILE):
        return None
    try:
        recorded = int((home / PORT_FILE).read_text().strip())
    except (OSError, ValueError):
        return default
    url = f"http://127.0.0.1:{recorded}/api"
    if answers(url):  # a server there must be this home's: a recorded port may have been taken since
        return recorded if serves_home(url, home) else None
    if recorded != default:
        profile = f"http://127.0.0.1:{default}/api"
        if answers(profile) and serves_home(profile, home):  # started by hand there since
            return default
    return recorded  # still starting


def serves_home(api_url: str, home: Path, timeout_s: float = 2.0) -> bool:
    """Whether the Prefect server at `api_url` runs with this PREFECT_HOME (its database is this home's):
    one started by hand (`prefect server start`) with the same home is this home's server too."""
    try:
        with urllib.request.urlopen(f"{api_url.rstrip('/')}/admin/settings", timeout=timeout_s) as resp:
            found = json.loads(resp.read()).get("home")
    except (OSError, urllib.error.URLError, ValueError, AttributeError):
        return False
    return isinstance(found, str) and Path(found).expanduser().resolve() == home.expanduser().resolve()


def port_busy(port: int) -> bool:
    """Whether something listens on 127.0.0.1:`port` (loopback: refused at once when nothing does)."""
    with socket.socket() as probe:
        probe.settimeout(HEALTH_TIMEOUT_S)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalServer:
    """`prefect server start --background` on 127.0.0.1:`port`, started now and waited for later."""

    def __init__(self, home: Path, port: int, services_off: dict[str, str] | None = None) -> None:
        self.home, self.port = home, port
        self.services_off = SERVICES_OFF if services_off is None else services_off
        self.api_url = f"http://127.0.0.1:{port}/api"
        self.ui_url = f"http://127.0.0.1:{port}"
        self.pid_file = home / PID_FILE
        self._cli: subprocess.Popen[bytes] | None = None

    def start(self) -> bool:
        """Start the server unless one of ours is already starting (its PID file names a live process).

        A PID file left by a server that died is removed first, as `prefect server stop` would.
        Returns whether this command started it.
        """
        if self.pid_file.exists():
            if _pid_alive(self.pid_file):
                return False
            self.pid_file.unlink(missing_ok=True)
        try:
            self.home.mkdir(parents=True, exist_ok=True)
            (self.home / PORT_FILE).write_text(str(self.port))
        except OSError as exc:
            raise LocalServerError(
                f"PREFECT_HOME {self.home} cannot hold the local Prefect server's files "
                f"({exc.strerror or exc}{'; it is a file, not a folder' if self.home.is_file() else ''}). "
                "Point PREFECT_HOME at a "
                "folder you can write, or set PREFECT_API_URL to a running Prefect server."
            ) from None
        prefect = Path(sys.executable).with_name("prefect")
        self._cli = subprocess.Popen(
            [
                str(prefect),
                "server",
                "start",
                "--background",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            env={
                **self.services_off,  # the user's own setting of any of them wins
                **os.environ,
                "PREFECT_HOME": str(self.home),
                # its own port, also where its UI sends the browser's API calls
                "PREFECT_SERVER_API_PORT": str(self.port),
                "PREFECT_UI_API_URL": self.api_url,
            },
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return True

    def wait(self, timeout_s: float) -> None:
        """Until the API answers; raise LocalServerError (with Prefect's words) once it cannot or did not."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if answers(self.api_url):
                self._reap()
                return
            cli_done = self._cli is None or self._cli.poll() is not None
            if cli_done and not self.pid_file.exists() and not answers(self.api_url):
                raise LocalServerError(self._failure("exited without starting it"))
            if cli_done and self.pid_file.exists() and not _pid_alive(self.pid_file):
                raise LocalServerError(self._failure("started it, and it stopped"))
            time.sleep(POLL_S)
        if self._cli is None:
            raise LocalServerError(
                f"No Prefect API is configured, and the Prefect server named in {self.pid_file} (started by "
                f"an earlier command) did not answer at {self.api_url} within {timeout_s:g} s. Run `prefect "
                f"server stop` with the same PREFECT_HOME to clear it, then run again; or set "
                f"PREFECT_API_URL, or ROLLFLOW_PREFECT__LOCAL_SERVER=ephemeral. Nothing was written to the "
                f"output."
            )
        raise LocalServerError(self._failure(f"did not make it answer within {timeout_s:g} s"))

    def _reap(self) -> str:
        if self._cli is None:
            return ""
        try:
            out, _ = self._cli.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            return ""
        paragraphs = [p for p in out.decode(errors="replace").split("\n\n") if p.strip()]
        return " ".join(paragraphs[-1].split()) if paragraphs else ""

    def _failure(self, what: str) -> str:
        said = self._reap()
        return (
            f"No Prefect API is configured, so rollflow started a local Prefect server with `prefect server "
            f"start --background --host 127.0.0.1 --port {self.port}` (PREFECT_HOME {self.home}), which "
            f"{what}{f': {said}' if said else ''}. Start one yourself (`prefect server start`) and set "
            f"PREFECT_API_URL={self.api_url}, or set ROLLFLOW_PREFECT__LOCAL_SERVER=ephemeral to use "
            f"Prefect's temporary server. Nothing was written to the output."
        )
