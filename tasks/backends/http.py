"""One aiohttp session per event loop: sessions cannot cross loops, and one per request is slow.

The session holds no secret: the backend's API key goes on each request (`auth_headers`, built once per
client), so the http verifier can share the loop's connection pool without ever receiving the key.
"""

from __future__ import annotations

import asyncio
import weakref

import aiohttp

from rollflow.settings import BackendSettings

_sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = (
    weakref.WeakKeyDictionary()
)


def auth_headers(settings: BackendSettings) -> dict[str, str]:
    """`Authorization: Bearer <key>` when an API key is set; merge into request headers, never log it."""
    if settings.api_key is None:
        return {}
    return {"Authorization": f"Bearer {settings.api_key.get_secret_value()}"}


def session_for_loop() -> aiohttp.ClientSession:
    """The running loop's session, created on first use inside the task that needs it.

    It depends on no backend's settings (the key goes on each request), so every caller shares it.
    limit=0: the caller bounds concurrency (one shared limit), a second cap here would only hide it.
    """
    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        _forget_closed_loops()
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            headers={"Content-Type": "application/json"},
            cookie_jar=aiohttp.DummyCookieJar(),  # backends set no cookies we need; skips per-reply work
            skip_auto_headers=("User-Agent",),
        )
        _sessions[loop] = session
    return session


async def close_loop_session() -> None:
    """Close and forget the running loop's session (call before the loop ends, e.g. in a finally)."""
    session = _sessions.pop(asyncio.get_running_loop(), None)
    if session is not None and not session.closed:
        await session.close()


def _forget_closed_loops() -> None:
    # A session refers to its loop, so a WeakKeyDictionary entry outlives a loop whose owner never
    # called close_loop_session; drop those here (rare: only when a new session is made).
    for loop in [lp for lp in list(_sessions) if lp.is_closed()]:
        _sessions.pop(loop, None)
