"""Driving `rollflow run` as a child process: the shared arguments, spawning, waiting for a kill point."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rollflow.infra.local import Service

ROWS = 1200


def run_args(inp: Path, out: str, sim: Service) -> list[str]:
    return [
        "run", "--input", str(inp), "--output", out, "--backend-kind", "agent", "--backend-url", sim.url,
        "--num-repeats", "2", "--parallelism", "16", "--chunk-size", "40", "--no-progress",
    ]  # fmt: skip


def spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    exe = str(Path(sys.executable).with_name("rollflow"))
    return subprocess.Popen([exe, *args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_until(predicate: Callable[[], bool], proc: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before the kill point: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.02)
    raise TimeoutError("kill point not reached")
