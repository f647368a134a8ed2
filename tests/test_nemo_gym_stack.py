"""The NeMo Gym stack is real: its environment servers run rollouts on the right stub and string_match scores
them, and NeMo Gym's own `ng_collect_rollouts` writes rollouts, a failures sidecar and aggregate metrics."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollflow.infra.nemo_gym.stack import Stack, http_json, nemo_gym_env
from rollflow.infra.nemo_gym.stub_model import FAIL_MARKER

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


def test_head_server_maps_each_agent_to_its_environment_server(nemo_gym_stack: Stack) -> None:
    servers = nemo_gym_stack.servers
    assert sorted(nemo_gym_stack.agents) == ["agent_a", "agent_b"]
    for agent in ("agent_a", "agent_b"):
        env = nemo_gym_stack.environment_server(agent)
        assert (env.name, env.kind, env.impl) == (
            f"{agent}_environment_server",
            "environment_servers",
            "legacy_agent",
        )
        model = servers[servers[agent].config["model_server"]["name"]]
        stub_url = nemo_gym_stack.stub_urls[nemo_gym_stack.stub_for(agent)]
        assert model.config["openai_base_url"] == f"{stub_url}/v1"
    assert {s.host for s in servers.values()} == {"127.0.0.1"}
    assert 11000 not in {s.port for s in servers.values()}
    assert nemo_gym_stack.config["head_server"]["host"] == "127.0.0.1"


def test_each_agent_is_answered_by_its_own_stub(nemo_gym_stack: Stack) -> None:
    """The same row to each environment server: A's reply matches the expected answer, B's does not."""
    for agent, reward in (("agent_a", 1.0), ("agent_b", 0.0)):
        stub = nemo_gym_stack.stub_for(agent)
        before = nemo_gym_stack.stub_requests(stub)["count"]
        url = f"{nemo_gym_stack.environment_server(agent).url}/run"
        result = http_json(url, row("what is 2+2", "answer from A: what is 2+2", agent))
        assert reply_text(result) == f"answer from {stub}: what is 2+2", nemo_gym_stack.log_tail()
        assert result["reward"] == reward
        assert result["extracted_answer"] == f"answer from {stub}: what is 2+2"
        seen = nemo_gym_stack.stub_requests(stub)
        assert seen["count"] == before + 1
        assert seen["last"][-1]["path"] == "/v1/responses"
        assert seen["last"][-1]["body"]["model"] == f"stub-{stub.lower()}"


def test_ng_collect_rollouts_writes_rollouts_and_aggregate_metrics(
    nemo_gym_stack: Stack, ng_bin: Callable[[str], Path], tmp_path: Path
) -> None:
    prompts = ["what is 2+2", "name a colour", "say hello", "count to three"]
    rows = [row(p, f"answer from A: {p}") for p in prompts[:3]] + [row(prompts[3], "three")]
    done, out = collect(nemo_gym_stack, ng_bin, tmp_path, rows)
    assert done.returncode == 0, f"{done.stderr[-4000:]}\n{nemo_gym_stack.log_tail()}"
    results = sorted(read_jsonl(out), key=lambda r: r["_ng_task_index"])
    assert [r["_ng_task_index"] for r in results] == [0, 1, 2, 3]
    for result, prompt in zip(results, prompts, strict=True):
        assert result["_ng_environment_server"] == "agent_a_environment_server"
        assert result["_ng_result_type"] == "legacy_agent"
        assert result["agent_ref"] == {"name": "agent_a"}
        assert reply_text(result) == f"answer from A: {prompt}"
    assert [r["reward"] for r in results] == [1.0, 1.0, 1.0, 0.0]
    assert (out.parent / "out_failures.jsonl").read_text() == ""
    metrics = json.loads((out.parent / "out_aggregate_metrics.json").read_text())
    assert [m["_ng_environment_server"] for m in metrics] == ["agent_a_environment_server"]
    assert metrics[0]["agent_ref"] == {"name": "agent_a"}
    assert metrics[0]["key_metrics"]["mean/reward"] == 0.75


def test_a_failed_model_call_lands_in_the_failures_sidecar(
    nemo_gym_stack: Stack, ng_bin: Callable[[str], Path], tmp_path: Path
) -> None:
    """The stub answers FAIL_MARKER with HTTP 400 (not retried): a sidecar row; the other row still scores."""
    rows = [row(f"{FAIL_MARKER} now", "x"), row("fine", "answer from A: fine")]
    done, out = collect(nemo_gym_stack, ng_bin, tmp_path, rows, "+route_failures_to_sidecar=true")
    assert done.returncode == 0, f"{done.stderr[-4000:]}\n{nemo_gym_stack.log_tail()}"
    assert [(r["_ng_task_index"], r["reward"]) for r in read_jsonl(out)] == [(1, 1.0)]
    (failure,) = read_jsonl(out.parent / "out_failures.jsonl")
    assert failure["_ng_failure_class"] == "agent_run_error"
    assert failure["_ng_failure_http_status"] == 500
    assert failure["_ng_task_index"] == 0
    assert failure["_ng_environment_server"] == "agent_a_environment_server"
    assert "stub A refuses" in failure["_ng_failure_response_body"]
