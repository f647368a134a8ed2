"""The processes a test stack starts: each in its own session, found and ended by it, its log read back."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

STOP_GRACE_S = 20.0


def tail(path: Path, limit: int = 6000) -> str:
    """The end of a log file, for error messages."""
    try:
        return path.read_bytes()[-limit:].decode(errors="replace")
    except OSError:
        return ""


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat after the command name (state is [0], session id [3]), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def session_members(sid: int) -> list[int]:
    """Every live process in session `sid`: what a process we started left behind, found by its id."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(entry.name)
            if fields is not None and int(fields[3]) == sid and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def rss_bytes(pids: Sequence[int]) -> int:
    """The summed resident set size of `pids` (VmRSS; shared pages count once per process)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def end_session(
    proc: subprocess.Popen[bytes], first: int = signal.SIGTERM, grace_s: float = STOP_GRACE_S
) -> None:
    """Signal a session leader we started, wait (bounded), then SIGKILL whatever is left in its session."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(first)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    # The engine core may outlive the API server by a moment: give the session a short while to empty.
    deadline = time.monotonic() + 5
    while session_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in session_members(proc.pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def default_sigint() -> None:
    """In the child: SIGINT back to its default, which a shell's `cmd &` leaves ignored (and exec keeps)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
