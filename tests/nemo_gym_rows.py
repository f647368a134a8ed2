"""Rows for the real NeMo Gym stack, and `ng_collect_rollouts` run against it (the drop-in tests' helpers)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollflow.infra.nemo_gym.stack import Stack, nemo_gym_env

COLLECT_TIMEOUT_S = 300


def row(prompt: str, expected: str, agent: str | None = None) -> dict[str, Any]:
    """A NeMo Gym row string_match scores: the whole reply must equal `expected` (case-insensitive)."""
    out: dict[str, Any] = {
        "responses_create_params": {"input": [{"role": "user", "content": prompt}]},
        "expected_answer": expected,
        "extraction_mode": "full_response",
    }
    if agent is not None:
        out["agent_ref"] = {"name": agent}
    return out


def reply_text(result: dict[str, Any]) -> str:
    """The assistant text of a rollout's response."""
    return "".join(c["text"] for item in result["response"]["output"] for c in item.get("content", []))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def collect(
    stack: Stack, ng_bin: Callable[[str], Path], tmp: Path, rows: list[dict[str, Any]], *extra: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run the real ng_collect_rollouts for agent_a against the stack's head server."""
    (tmp / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp / "out" / "out.jsonl"
    port = stack.head_url.rsplit(":", 1)[1]
    args = [
        str(ng_bin("ng_collect_rollouts")), "+agent_name=agent_a", f"+input_jsonl_fpath={tmp / 'in.jsonl'}",
        f"+output_jsonl_fpath={out}", "+head_server.host=127.0.0.1", f"+head_server.port={port}", *extra,
    ]  # fmt: skip
    done = subprocess.run(
        args, cwd=tmp, env=nemo_gym_env(), capture_output=True, text=True, timeout=COLLECT_TIMEOUT_S
    )
    return done, out
