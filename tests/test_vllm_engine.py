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


def test_the_limit_follows_vllm_when_another_tenant_takes_half_of_it(run_cli, vllm, tmp_path: Path) -> None:
    """`--parallelism adaptive` on vLLM (16 sequences at once): the limit starts from the capacity vLLM
    states and settles near 16; while another tenant keeps 8 long requests running, it falls to at most
    8 + the small queue it keeps (within 4 intervals of the tenant's arrival), and rises again after.
    Nothing is lost and vLLM never preempts."""
    inp, out = _rows(tmp_path / "rows.jsonl", 700, 24), tmp_path / "out"
    window: dict[str, float] = {}
    tenant = threading.Thread(target=_tenant, args=(vllm, window, 8, 15.0), daemon=True)
    preempted_before = vllm.metric("vllm:num_preemptions_total") or 0
    tenant.start()
    res = _collect(run_cli, inp, out, vllm.base_url, "chat", vllm.model, "--parallelism", "adaptive")
    tenant.join(60)
    assert res.returncode == 0, res.stderr[-3000:]
    report = orjson.loads((out / "report.json").read_bytes())
    control = report["adaptive"]
    history = control["history"]
    shown = [(round(h["at"] - window.get("start", 0), 1), h["limit"], h["why"]) for h in history]
    assert control["mode"] == "engine" and "KV cache holds" in next(iter(control["started"].values()))
    assert {"start", "end"} <= set(window), (window, shown)  # the tenant came while the run went on
    during = [h["limit"] for h in history if window["start"] < h["at"] <= window["end"]]
    assert len(during) >= 8 and max(during[4:]) <= 8 + 2 + 1, shown
    before = [h["limit"] for h in history if h["at"] <= window["start"] and h.get("running")]
    assert before and max(before) >= 14, shown  # near vLLM's 16 before the tenant came
    after = [h["limit"] for h in history if h["at"] > window["end"] + 4 and h.get("in_flight")]
    assert not after or max(after) >= 14, shown
    assert (vllm.metric("vllm:num_preemptions_total") or 0) == preempted_before
    assert len((out / "rollouts.jsonl").read_bytes().splitlines()) == 700 and report["failed"] == 0


def _tenant(vllm: Any, window: dict[str, float], workers: int, hold_s: float) -> None:
    """Another user of the same vLLM: once the run has at least 10 running, `workers` long requests back
    to back for `hold_s` seconds; `window` gets its start and end (epoch seconds)."""
    import time

    import httpx

    deadline = time.monotonic() + 240
    while (vllm.metric("vllm:num_requests_running") or 0) < 10:
        if time.monotonic() > deadline:
            return
        time.sleep(0.2)
    time.sleep(3)
    window["start"] = time.time()
    stop = time.monotonic() + hold_s
    body = {"model": vllm.model, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 400, "ignore_eos": True}  # fmt: skip

    def worker() -> None:
        with httpx.Client(timeout=120) as client:
            while time.monotonic() < stop:
                client.post(f"{vllm.base_url}/v1/chat/completions", json=body).raise_for_status()

    threads = [threading.Thread(target=worker) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    window["end"] = time.time()
