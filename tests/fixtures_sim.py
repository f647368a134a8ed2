"""The simulated backend in its own process: a reusable starter and session fixtures."""

from __future__ import annotations

import re
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollflow.infra.local import Service, spawn_simulator

REPO = Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"rollflow simulator listening on (http://\S+)")


def start_simulator_process(*args: str, timeout_s: float = 30.0) -> tuple[subprocess.Popen[str], str]:
    """`python -m rollflow.infra.simulator --port 0 *args`; its URL is read from the "listening on" line."""
    cmd = [sys.executable, "-m", "rollflow.infra.simulator", "--port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            found = LISTENING.search(line)
            if found:
                return proc, found.group(1)
            if not line:
                break
        elif proc.poll() is not None:
            break
    stop_process(proc)
    raise RuntimeError(f"simulator {args} did not report its address (exit code {proc.returncode})")


def stop_process(proc: subprocess.Popen[str]) -> int:
    """SIGTERM, then SIGKILL after 10 s; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode


@pytest.fixture(scope="session")
def simulator() -> Iterator[str]:
    """URL of a fast simulator (1 ms latency, 256 slots) shared by the session."""
    proc, url = start_simulator_process("--latency-ms", "1", "--slots", "256")
    yield url
    stop_process(proc)


@pytest.fixture(scope="session")
def fast_sim() -> Iterator[Service]:
    """The same fast simulator as a Service (for tests that want .url and .stop())."""
    sim = spawn_simulator("--latency-ms", "1", "--slots", "256")
    yield sim
    sim.stop()
