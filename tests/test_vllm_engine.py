"""rollflow against a real vLLM (CPU build, a tiny random Llama): every row keeps what vLLM sent, field for
field, through the chat and the Responses API; and vLLM's own gauges are read while it runs."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from reply_leaves import leaves
from zoo_servers import ThreadedServer


def _rows(path: Path, n: int, tokens: int) -> Path:
    with path.open("wb") as fh:
        for i in range(n):
            params = {"input": [{"role": "user", "content": f"Count from {i} to {i + 5}."}]}
            row = {"responses_create_params": {**params, "max_output_tokens": tokens}, "expected_answer": "x"}
            fh.write(orjson.dumps(row) + b"\n")
    return path


class Recorder:
    """A loopback proxy in front of vLLM that keeps every reply body it passes on, as vLLM sent it."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.replies: list[dict[str, Any]] = []
        self.server = ThreadedServer(self._forward)
        self._session: aiohttp.ClientSession | None = None

    async def _forward(self, request: web.Request) -> web.Response:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
        body = await request.read()
        headers = {"Content-Type": "application/json"}
        async with self._session.post(f"{self.upstream}{request.path}", data=body, headers=headers) as resp:
            data = await resp.read()
            if resp.status == 200:
                self.replies.append(orjson.loads(data))
            return web.Response(status=resp.status, body=data, content_type="application/json")

    def __enter__(self) -> Recorder:
        self.server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._session is not None:
            asyncio.run_coroutine_threadsafe(self._session.close(), self.server.loop).result(10)
        self.server.__exit__(*exc)


def _collect(run_cli, inp: Path, out: Path, url: str, kind: str, model: str, *extra: str):
    return run_cli(
        "collect", "--input", str(inp), "--output", str(out), "--backend-kind", kind, "--backend-url", url,
        "--model", model, "--verifier", "exact_match", "--verify-processes", "0", "--no-progress",
        "--timeout-s", "120", *extra,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_every_row_keeps_what_vllm_sent(run_cli, vllm, tmp_path: Path, kind: str) -> None:
    inp, out = _rows(tmp_path / "rows.jsonl", 12, 12), tmp_path / "out"
    with Recorder(vllm.base_url) as proxy:
        res = _collect(run_cli, inp, out, proxy.server.url, kind, vllm.model, "--num-repeats", "2",
                       "--parallelism", "8")  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [orjson.loads(line) for line in (out / "rollouts.jsonl").read_bytes().splitlines()]
    assert len(rows) == 24 and len(proxy.replies) == 24
    by_id = {row["response"]["id"]: row["response"] for row in rows}
    assert len(by_id) == 24  # each row is one reply of its own
    for reply in proxy.replies:
        response = by_id[reply["id"]]
        lost = leaves(reply) - leaves(response)
        assert not lost, f"lost {lost} of vLLM's reply {reply} in {response}"
        if kind == "responses":
            assert response == reply  # the Responses API's reply is the row's response, as sent


def test_vllms_own_gauges_are_read_while_it_runs(run_cli, vllm, tmp_path: Path) -> None:
    """Twice vLLM's max_num_seqs in flight: its gauges show 16 running and the rest waiting for capacity."""
    inp, out = _rows(tmp_path / "rows.jsonl", 96, 48), tmp_path / "out"
    res = _collect(run_cli, inp, out, vllm.base_url, "chat", vllm.model, "--parallelism", "32")
    assert res.returncode == 0, res.stderr[-3000:]
    report = orjson.loads((out / "report.json").read_bytes())
    engine = report["endpoints"][0]["engine"]
    assert engine is not None, report["endpoints"]
    assert engine["running_max"] == vllm.max_num_seqs, engine
    assert engine["waiting_max"] > 0 and 0 < engine["kv_cache_usage_max"] <= 1, engine


def test_the_limit_follows_vllms_capacity_alone_and_beside_another_tenant(
    run_cli, vllm, tmp_path: Path
) -> None:
    """`--parallelism adaptive` on vLLM (16 sequences at once) starts from the capacity vLLM states and
    settles at its 16 plus the small queue it keeps; with another tenant holding 8 long requests there,
    it settles at 8 plus that queue. Nothing is lost and vLLM never preempts."""
    preempted_before = vllm.metric("vllm:num_preemptions_total")
    alone = _adaptive_run(run_cli, vllm, tmp_path / "alone")
    stop = threading.Event()
    tenant = [threading.Thread(target=_tenant, args=(vllm, stop), daemon=True) for _ in range(8)]
    for t in tenant:
        t.start()
    try:
        _wait_for_running(vllm, 8)
        shared = _adaptive_run(run_cli, vllm, tmp_path / "shared")
    finally:
        stop.set()
        for t in tenant:
            t.join(120)
    for control in (alone, shared):
        assert control["mode"] == "engine", control
        assert "KV cache holds" in next(iter(control["started"].values())), control["started"]
    settled = {name: _settled(c["history"]) for name, c in (("alone", alone), ("shared", shared))}
    queue = 2  # the least the controller keeps waiting (EngineOptions.min_queue)
    assert 8 <= settled["alone"] <= 16 + queue + 1, (settled, _shown(alone))
    assert settled["shared"] <= 8 + queue + 1 < settled["alone"] + 4, (settled, _shown(shared))
    assert vllm.metric("vllm:num_preemptions_total") == preempted_before


def _adaptive_run(run_cli, vllm: Any, folder: Path) -> dict[str, Any]:
    folder.mkdir()
    inp, out = _rows(folder / "rows.jsonl", 400, 24), folder / "out"
    res = _collect(run_cli, inp, out, vllm.base_url, "chat", vllm.model, "--parallelism", "adaptive")
    assert res.returncode == 0, res.stderr[-3000:]
    report = orjson.loads((out / "report.json").read_bytes())
    assert len((out / "rollouts.jsonl").read_bytes().splitlines()) == 400 and report["failed"] == 0
    return report["adaptive"]


def _settled(history: list[dict[str, Any]]) -> int:
    """The limit over the run's second half (the highest it held there)."""
    return max(h["limit"] for h in history[len(history) // 2 :])


def _shown(control: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [
        (h["t_s"], h["limit"], h.get("running"), h.get("waiting"), h["why"][:60]) for h in control["history"]
    ]


def _wait_for_running(vllm: Any, n: int, timeout_s: float = 120) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while vllm.metric("vllm:num_requests_running") < n:
        assert time.monotonic() < deadline, f"the tenant's {n} requests never ran"
        time.sleep(0.2)


def _tenant(vllm: Any, stop: threading.Event) -> None:
    """Another user of the same vLLM: one long request after another until `stop`."""
    import httpx

    body = {"model": vllm.model, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 1500, "ignore_eos": True}  # fmt: skip
    with httpx.Client(timeout=600) as client:
        while not stop.is_set():
            client.post(f"{vllm.base_url}/v1/chat/completions", json=body).raise_for_status()
