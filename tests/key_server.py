"""A backend on 127.0.0.1 that answers only requests carrying one API key, in its own thread (so a child
process such as `rollflow` or a Dask worker can reach it while the test waits)."""

from __future__ import annotations

import asyncio
import threading

import orjson
from aiohttp import web
from local_http import DEFAULT_REPLY, RESPONSE, ScriptedServer


class KeyServer:
    def __init__(self, key: str) -> None:
        self.key = key
        self.server = ScriptedServer()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.url = ""

    async def _reply(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": {"message": "invalid api key"}}, status=401)
        return web.Response(body=orjson.dumps(DEFAULT_REPLY[request.path]), content_type="application/json")

    def __enter__(self) -> KeyServer:
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self.server.start(self._reply), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def keys_seen(self) -> set[str | None]:
        return {seen.headers.get("Authorization") for seen in list(self.server.seen)}


class EchoServer(KeyServer):
    """A Responses backend whose reply text is the request's input: each row says what the model answers."""

    def __init__(self) -> None:
        super().__init__(key="")

    async def _reply(self, request: web.Request) -> web.Response:
        text = (await request.json())["input"]
        message = {**RESPONSE["output"][1], "content": [{"type": "output_text", "text": text}]}
        return web.json_response({**RESPONSE, "output": [message]})
