"""What every benchmark needs: servers on loopback, a generated input, a timed `rollflow` subprocess."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from rollflow.infra.local import Service, spawn_prefect_server, spawn_simulator

REPO = Path(__file__).resolve().parent.parent

__all__ = [
    "REPO",
    "RunResult",
    "Service",
    "run_rollflow",
    "spawn_prefect_server",
    "spawn_simulator",
    "write_input",
]


def write_input(path: Path, rows: int, seed: int = 0, max_output_tokens: int | None = None) -> Path:
    """NeMo Gym rows with short arithmetic prompts, streamed to disk (`max_output_tokens`: a real model's
    reply length, which a randomly initialised one never ends by itself)."""
    rnd = random.Random(seed)
    with path.open("wb") as fh:
        for i in range(rows):
            a, b = rnd.randint(1, 999), rnd.randint(1, 999)
            row = {
                "responses_create_params": {
                    "input": [{"role": "user", "content": f"#{i}: what is {a} + {b}?"}],
                    **({"max_output_tokens": max_output_tokens} if max_output_tokens else {}),
                },
                "agent_ref": {"type": "responses_api_agents", "name": "bench_agent"},
                "expected_answer": str(a + b),
            }
            fh.write(orjson.dumps(row) + b"\n")
    return path


def run_args(
    inp: Path | str,
    url: str,
    *,
    parallelism: int | str,
    repeats: int = 1,
    kind: str = "agent",
    extra: tuple = (),
) -> list[str]:
    """`rollflow run` arguments every benchmark shares."""
    return [
        "run", "--input", str(inp), "--backend-kind", kind, "--backend-url", url,
        "--num-repeats", str(repeats), "--parallelism", str(parallelism), *extra,
    ]  # fmt: skip


@dataclass
class RunResult:
    returncode: int
    wall_s: float
    report: dict[str, Any]
    stderr: str


def run_rollflow(args: list[str], env: dict[str, str], output: Path, timeout_s: float = 900) -> RunResult:
    """Run the CLI in its own process and read back report.json."""
    exe = Path(sys.executable).with_name("rollflow")
    full_env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **env}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [str(exe), *args, "--output", str(output), "--no-progress"],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    wall = time.perf_counter() - t0
    report_path = output / "report.json"
    report = orjson.loads(report_path.read_bytes()) if report_path.exists() else {}
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
    return RunResult(proc.returncode, wall, report, proc.stderr)
