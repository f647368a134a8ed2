"""Bounded retries with backoff against small real servers on 127.0.0.1: what is retried and what is not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp import web
from pydantic import SecretStr

from rollflow.infra.local import free_port
from rollflow.settings import BackendSettings
from rollflow.tasks.backends.backends import BackendClient, BackendError
from rollflow.tasks.backends.http import close_loop_session, session_for_loop

ROW = {"responses_create_params": {"input": "hi"}}
REPLY = b'{"output": [{"type": "message", "content": [{"type": "output_text", "text": "ok"}]}], "usage": {"output_tokens": 3}}'  # noqa: E501


@pytest.fixture
async def server() -> AsyncIterator[Callable[[list[web.Response | str]], str]]:
    runners: list[web.AppRunner] = []
    seen: list[dict[str, str]] = []
    peers: list[tuple[str, int] | None] = []

    async def start(script: list[web.Response | str]) -> str:
        async def handler(request: web.Request) -> web.StreamResponse:
            seen.append(dict(request.headers))
            peers.append(request.transport.get_extra_info("peername") if request.transport else None)
            step = script.pop(0) if len(script) > 1 else script[0]
            if step == "hang":
                await asyncio.sleep(2)
            if isinstance(step, str):
                return web.Response(body=REPLY, content_type="application/json")
            return step

        app = web.Application()
        app.router.add_post("/v1/responses", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    start.seen = seen  # type: ignore[attr-defined]
    start.peers = peers  # type: ignore[attr-defined]
    yield start
    await close_loop_session()
    for runner in runners:
        await runner.cleanup()


def client(url: str, **kw: object) -> BackendClient:
    settings = BackendSettings(kind="responses", url=url, backoff_base_s=0.01, **kw)
    return BackendClient(settings, session_for_loop())


async def test_5xx_retried_then_ok(server) -> None:
    url = await server([web.Response(status=503), web.Response(status=502), "ok"])
    result = await client(url).rollout(ROW, 0, 0)
    assert result.attempts == 3 and result.text == "ok" and result.output_tokens == 3


async def test_retry_after_is_honoured(server) -> None:
    url = await server([web.Response(status=429, headers={"Retry-After": "1"}), "ok"])
    t0 = time.perf_counter()
    result = await client(url).rollout(ROW, 0, 0)
    assert result.attempts == 2 and time.perf_counter() - t0 >= 0.95


async def test_4xx_fails_at_once(server) -> None:
    url = await server([web.Response(status=400, text="bad request: no model")])
    with pytest.raises(BackendError) as info:
        await client(url).rollout(ROW, 0, 0)
    assert info.value.attempts == 1 and not info.value.retryable and info.value.kind == "http_400"
    assert "no model" in str(info.value)


@pytest.mark.alone  # asserts < 3 s
async def test_hang_times_out_and_is_bounded(server) -> None:
    url = await server(["hang"])
    t0 = time.perf_counter()
    with pytest.raises(BackendError) as info:
        await client(url, timeout_s=0.3, max_retries=2).rollout(ROW, 0, 0)
    assert info.value.kind == "timeout" and info.value.attempts == 3
    assert time.perf_counter() - t0 < 3


async def test_malformed_body_retried(server) -> None:
    url = await server([web.Response(body=b'{"output": [', content_type="application/json"), "ok"])
    assert (await client(url).rollout(ROW, 0, 0)).attempts == 2


async def test_connection_refused(server) -> None:
    with pytest.raises(BackendError) as info:
        await client(f"http://127.0.0.1:{free_port()}", max_retries=2).rollout(ROW, 0, 0)
    assert info.value.kind == "connection" and info.value.attempts == 3


async def test_api_key_sent_never_in_errors(server) -> None:
    url = await server([web.Response(status=401, text="denied")])
    settings = BackendSettings(kind="responses", url=url, api_key=SecretStr("sk-hidden-123"))
    with pytest.raises(BackendError) as info:
        await BackendClient(settings, session_for_loop()).rollout(ROW, 5, 1)
    assert "sk-hidden-123" not in str(info.value) and "sk-hidden-123" not in repr(settings)
    headers = server.seen[-1]
    assert headers["Authorization"] == "Bearer sk-hidden-123"
    assert headers["X-Rollflow-Task-Index"] == "5" and headers["X-Rollflow-Rollout-Index"] == "1"


async def test_one_session_per_loop_reused_then_closed(server) -> None:
    """Requests of one loop share a session and its connections; another loop gets its own."""
    url = await server(["ok"])
    first = session_for_loop()
    for _ in range(3):
        await client(url).rollout(ROW, 0, 0)
    assert session_for_loop() is first and not first.closed
    assert len(set(server.peers)) == 1, "one kept-alive connection for every request"
    other = await asyncio.to_thread(asyncio.run, _session_in_new_loop())
    assert other is not first and other.closed and not first.closed
    await close_loop_session()
    assert first.closed and session_for_loop() is not first


async def _session_in_new_loop() -> aiohttp.ClientSession:
    session = session_for_loop()
    assert session_for_loop() is session
    await close_loop_session()
    return session
