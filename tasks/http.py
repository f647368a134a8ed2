"""One aiohttp session per event loop: sessions cannot cross loops, and one per request is slow."""

from __future__ import annotations

import asyncio
import weakref

import aiohttp

from settings import BackendSettings

_sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession] = (
    weakref.WeakKeyDictionary()
)


def session_for_loop(settings: BackendSettings) -> aiohttp.ClientSession:
    """The running loop's session, created on first use inside the task that needs it."""
    loop = asyncio.get_running_loop()
    session = _sessions.get(loop)
    if session is None or session.closed:
        headers = {"Content-Type": "application/json"}
        if settings.api_key is not None:
            headers["Authorization"] = f"Bearer {settings.api_key.get_secret_value()}"
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            headers=headers,
            json_serialize=None,
            skip_auto_headers=("User-Agent",),
        )
        _sessions[loop] = session
    return session


async def close_loop_session() -> None:
    loop = asyncio.get_running_loop()
    session = _sessions.pop(loop, None)
    if session is not None and not session.closed:
        await session.close()
