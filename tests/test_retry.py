"""Backoff policy and what is retried, against real servers on 127.0.0.1 (and a closed port)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import pytest
from aiohttp import web
from local_http import ScriptedServer, serve_garbage

from rollflow.infra.local import free_port
from rollflow.settings import BackendSettings
from rollflow.tasks.backends.backends import BackendClient, BackendError
from rollflow.tasks.backends.http import close_loop_session, session_for_loop
from rollflow.tasks.backends.observe import AttemptLog
from rollflow.tasks.backends.retry import RetryPolicy, parse_retry_after

ROW = {"responses_create_params": {"input": "hi"}}


def client(url: str, observers: tuple[AttemptLog, ...] = (), **kw: object) -> BackendClient:
    settings = BackendSettings(kind="responses", url=url, **{"backoff_base_s": 0.01, **kw})
    return BackendClient(settings, session_for_loop(), observers)


def test_delay_full_jitter_bounds() -> None:
    policy = RetryPolicy(max_retries=5, base_s=0.5, max_s=3.0)
    for attempt, cap in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 3.0), (10, 3.0), (500, 3.0)]:
        delays = [policy.delay(attempt) for _ in range(300)]
        assert all(0 <= d <= cap for d in delays) and max(delays) > cap * 0.7


def test_delay_honours_retry_after_capped() -> None:
    policy = RetryPolicy(max_retries=5, base_s=0.5, max_s=3.0)
    assert all(2.0 <= policy.delay(0, 2.0) <= 2.25 for _ in range(100))
    assert all(3.0 <= policy.delay(4, 120.0) <= 3.25 for _ in range(100))
    assert RetryPolicy.from_settings(BackendSettings(max_retries=2)).max_retries == 2


def test_parse_retry_after() -> None:
    assert (
        parse_retry_after("1") == 1.0 and parse_retry_after("0.5") == 0.5 and parse_retry_after("-3") == 0.0
    )
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past: now
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    assert 25 < (parse_retry_after(later) or 0) <= 30
    assert parse_retry_after(None) is None and parse_retry_after("nan") is None


async def test_503_twice_then_ok(server: ScriptedServer) -> None:
    url = await server.start(web.Response(status=503), web.Response(status=503), "ok")
    log = AttemptLog()
    result = await client(url, (log,)).rollout(ROW, 0, 0)
    assert result.attempts == 3 and result.text == "x = 42" and len(server.seen) == 3
    assert log.ok == 1 and log.errors == {"http_503": 2}


async def test_429_retry_after_waits(server: ScriptedServer) -> None:
    url = await server.start(web.Response(status=429, headers={"Retry-After": "1"}), "ok")
    t0 = time.perf_counter()
    result = await client(url).rollout(ROW, 0, 0)
    assert result.attempts == 2 and time.perf_counter() - t0 >= 0.95


@pytest.mark.parametrize("status", [400, 404, 422])
async def test_other_4xx_fails_at_once(server: ScriptedServer, status: int) -> None:
    url = await server.start(web.Response(status=status, text="nope"))
    with pytest.raises(BackendError) as info:
        await client(url).rollout(ROW, 0, 0)
    err = info.value
    assert (err.kind, err.status, err.attempts, err.retryable) == (f"http_{status}", status, 1, False)
    assert len(server.seen) == 1


async def test_5xx_exhausts_retries(server: ScriptedServer) -> None:
    url = await server.start(web.Response(status=500, text="boom"))
    with pytest.raises(BackendError) as info:
        await client(url, max_retries=3).rollout(ROW, 0, 0)
    assert info.value.kind == "http_500" and info.value.attempts == 4 and info.value.retryable
    assert "boom" in str(info.value) and len(server.seen) == 4


@pytest.mark.alone  # asserts the timeout fires within 0.45-1.5 s
async def test_hanging_server_times_out(server: ScriptedServer) -> None:
    url = await server.start("hang")
    t0 = time.perf_counter()
    with pytest.raises(BackendError) as info:
        await client(url, timeout_s=0.5, max_retries=0).rollout(ROW, 0, 0)
    assert info.value.kind == "timeout" and info.value.attempts == 1 and info.value.retryable
    assert 0.45 < time.perf_counter() - t0 < 1.5


async def test_connection_refused_after_max_retries() -> None:
    with pytest.raises(BackendError) as info:
        await client(f"http://127.0.0.1:{free_port()}", max_retries=2).rollout(ROW, 0, 0)
    assert info.value.kind == "connection" and info.value.attempts == 3
    await close_loop_session()


async def test_malformed_2xx_retried(server: ScriptedServer) -> None:
    url = await server.start(web.Response(body=b"<html>oops", content_type="text/html"), "ok")
    assert (await client(url).rollout(ROW, 0, 0)).attempts == 2


async def test_malformed_for_good(server: ScriptedServer) -> None:
    url = await server.start(web.Response(body=b'{"output": [', content_type="application/json"))
    with pytest.raises(BackendError) as info:
        await client(url, max_retries=1).rollout(ROW, 0, 0)
    assert info.value.kind == "malformed" and info.value.attempts == 2 and info.value.status == 200


async def test_garbled_http_is_a_retried_connection_error() -> None:
    srv, url = await serve_garbage(b"NOT HTTP AT ALL\r\n\r\n")
    try:
        with pytest.raises(BackendError) as info:
            await client(url, max_retries=1).rollout(ROW, 0, 0)
        assert info.value.kind == "connection" and info.value.attempts == 2
    finally:
        await close_loop_session()
        srv.close()
        await srv.wait_closed()
