"""A scripted HTTP server on 127.0.0.1 for backend, retry and verifier tests: real sockets, no mocks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web

from rollflow.tasks.backends.http import close_loop_session

RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "model": "m",
    "output": [
        {"type": "reasoning", "summary": []},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "x = "}, {"type": "output_text", "text": "42"}],
        },
    ],
    "usage": {"input_tokens": 5, "output_tokens": 7, "total_tokens": 12},
}
CHAT = {
    "id": "chatcmpl_1",
    "object": "chat.completion",
    "model": "m",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": r"so \boxed{42}"}, "finish_reason": "stop"}
    ],
    "usage": {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15},
}
AGENT = {"response": RESPONSE, "reward": 1.0, "extra": {"judge": "ok"}}
DEFAULT_REPLY = {
    "/run": AGENT,
    "/v1/responses": RESPONSE,
    "/v1/chat/completions": CHAT,
    "/verify": {"reward": 1.0},
}

# A step of a script: "ok" (the path's default reply), "hang" (no reply at all), "stall_body" (headers, then
# nothing), a dict (sent as JSON), a web.Response, or a handler coroutine function.
Step = str | dict[str, Any] | web.Response | Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


@dataclass
class ScriptedServer:
    """Each request takes the next step of the script; the last step repeats. Records every request."""

    script: list[Step] = field(default_factory=lambda: ["ok"])
    seen: list[Seen] = field(default_factory=list)
    runner: web.AppRunner | None = None
    url: str = ""

    async def start(self, *script: Step) -> str:
        if script:
            self.script = list(script)
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1, handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(Seen(request.path, dict(request.headers), await request.read()))
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if step == "hang":
            await asyncio.sleep(3600)
        if step == "stall_body":
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = 100
            await resp.prepare(request)
            await resp.write(b'{"output": ')
            await asyncio.sleep(3600)
        if step == "ok":
            return web.Response(
                body=orjson.dumps(DEFAULT_REPLY[request.path]), content_type="application/json"
            )
        if isinstance(step, dict):
            return web.Response(body=orjson.dumps(step), content_type="application/json")
        if isinstance(step, web.Response):  # a response is sent once: repeat a copy
            return web.Response(status=step.status, body=step.body, headers=step.headers.copy())
        return await step(request)


async def serve_garbage(reply: bytes) -> tuple[asyncio.Server, str]:
    """A TCP server answering every connection with `reply` (not HTTP), then closing it."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.write(reply)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def server() -> AsyncIterator[ScriptedServer]:
    """A scripted backend for one test; the loop's session is closed before it stops."""
    srv = ScriptedServer()
    yield srv
    await close_loop_session()
    await srv.stop()
