"""The run's progress bar ends at what was counted, even when an update is slow to reach the server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rollflow.flows import artifacts as artifacts_module
from rollflow.flows.artifacts import rollout_progress
from rollflow.tasks.collect.progress import ProgressEvent, hub

HOLD_S = 1.5


@dataclass
class SlowGateway:
    """A reverse proxy to the Prefect API that holds the first artifact update for HOLD_S, as a busy
    gateway may. The request reaches the server even if its client gave up, after any sent later."""

    upstream: str
    refuse_updates: bool = False  # answer every update 503, as a gateway whose upstream is down
    hold_s: float = HOLD_S
    session: aiohttp.ClientSession | None = None
    runner: web.AppRunner | None = None
    held: bool = False
    holding: bool = False
    held_at_end: bool = False
    forwarding: int = 0
    artifact_ids: list[str] = field(default_factory=list)
    updates: list[float] = field(default_factory=list)  # in the order the server received them

    async def start(self) -> str:
        self.session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self.runner = web.AppRunner(app, handler_cancellation=False)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}/api"

    async def stop(self) -> None:
        assert self.runner is not None and self.session is not None
        await self.runner.cleanup()
        await self.session.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return await self._forward_websocket(request)
        body = await request.read()
        update = request.method == "PATCH" and "/artifacts/" in request.path
        self.forwarding += 1
        try:
            if update and self.refuse_updates:
                return web.Response(status=503, text="upstream unavailable")
            if update and not self.held:
                self.held = self.holding = True
                await asyncio.sleep(self.hold_s)
                self.holding = False
            if update:
                self.updates.append(float(json.loads(body)["data"]))
            headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
            url = self.upstream + request.path_qs.removeprefix("/api")
            async with self.session.request(request.method, url, data=body, headers=headers) as reply:
                data = await reply.read()
                if request.method == "POST" and request.path.rstrip("/").endswith("/artifacts"):
                    self.artifact_ids.append(json.loads(data)["id"])
                return web.Response(body=data, status=reply.status, content_type=reply.content_type)
        finally:
            self.forwarding -= 1

    async def _forward_websocket(self, request: web.Request) -> web.WebSocketResponse:
        """The client's event stream, passed through both ways."""
        assert self.session is not None
        url = self.upstream.replace("http", "ws", 1) + request.path_qs.removeprefix("/api")
        async with self.session.ws_connect(url) as upstream:
            client = web.WebSocketResponse()
            await client.prepare(request)

            async def pump(source: Any, sink: Any) -> None:
                async for message in source:
                    if message.type == aiohttp.WSMsgType.TEXT:
                        await sink.send_str(message.data)
                    elif message.type == aiohttp.WSMsgType.BINARY:
                        await sink.send_bytes(message.data)
                await sink.close()

            await asyncio.gather(pump(client, upstream), pump(upstream, client), return_exceptions=True)
            return client


Body = Callable[[SlowGateway], Awaitable[None]]


async def _progress_through(
    api: str, body: Body, refuse_updates: bool = False, hold_s: float = HOLD_S
) -> tuple[SlowGateway, float]:
    """`body` run inside `rollout_progress(total=4)` with the Prefect API behind the gateway; the gateway
    (`held_at_end`: an update was still held when the run's end returned) and the bar's value on the
    server once everything it forwards has arrived."""
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    gateway = SlowGateway(api, refuse_updates=refuse_updates, hold_s=hold_s)
    url = await gateway.start()
    try:
        with temporary_settings({PREFECT_API_URL: url, PREFECT_CLIENT_MAX_RETRIES: 0}):
            try:
                async with rollout_progress(total=4, interval_s=0.05):
                    await body(gateway)
                gateway.held_at_end = gateway.holding
            finally:
                await asyncio.to_thread(EventsWorker.drain_all, 10)  # its events use the gateway too
        for _ in range(100):
            if not gateway.forwarding:
                break
            await asyncio.sleep(0.05)
        assert not gateway.forwarding, gateway.forwarding
        (artifact_id,) = gateway.artifact_ids
        async with aiohttp.ClientSession() as session, session.get(f"{api}/artifacts/{artifact_id}") as reply:
            return gateway, (await reply.json())["data"]
    finally:
        await gateway.stop()


def _api(prefect_server: Any) -> str:
    return prefect_server.env["PREFECT_API_URL"].rstrip("/")


async def _until(check: Callable[[], bool]) -> None:
    for _ in range(200):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the gateway saw no update")


@pytest.mark.filterwarnings("ignore:Artifact creation outside:FutureWarning")
def test_the_bar_ends_at_the_final_count_when_an_earlier_update_is_held(prefect_server) -> None:
    """An update still travelling when the run ends must not land after the final one (it read 0% once
    in a served run whose chunks ended within the first refresh)."""

    async def body(gateway: SlowGateway) -> None:
        await asyncio.sleep(0.2)
        hub.emit(ProgressEvent("rollouts", done=4, chunk=0))
        await asyncio.sleep(0.2)

    gateway, shown = asyncio.run(_progress_through(_api(prefect_server), body))
    assert gateway.held and gateway.updates and gateway.updates[-1] == 100.0, gateway.updates
    assert shown == 100.0, (shown, gateway.updates)


@pytest.mark.filterwarnings("ignore:Artifact creation outside:FutureWarning")
def test_the_count_reached_while_an_update_travels_is_shown_at_the_end(prefect_server) -> None:
    """Half done, that update held; the run finishes and ends meanwhile: the bar still ends at 100%."""

    async def body(gateway: SlowGateway) -> None:
        hub.emit(ProgressEvent("rollouts", done=2, chunk=0))
        await _until(lambda: gateway.holding)
        hub.emit(ProgressEvent("rollouts", done=2, chunk=1))

    gateway, shown = asyncio.run(_progress_through(_api(prefect_server), body))
    assert gateway.updates == [50.0, 100.0], gateway.updates
    assert shown == 100.0, (shown, gateway.updates)


@pytest.mark.filterwarnings("ignore:Artifact creation outside:FutureWarning")
def test_a_refused_update_neither_fails_the_run_nor_hides_its_error(prefect_server) -> None:
    """Every update answered 503: a run that succeeded still succeeds, one that failed raises its own
    error, not the artifact's."""

    async def finishes(gateway: SlowGateway) -> None:
        hub.emit(ProgressEvent("rollouts", done=4, chunk=0))
        await asyncio.sleep(0.2)

    async def fails(gateway: SlowGateway) -> None:
        await finishes(gateway)
        raise ValueError("the run's own error")

    _, shown = asyncio.run(_progress_through(_api(prefect_server), finishes, refuse_updates=True))
    assert shown == 0.0, "the gateway refused every update"
    with pytest.raises(ValueError, match="the run's own error"):
        asyncio.run(_progress_through(_api(prefect_server), fails, refuse_updates=True))


@pytest.mark.filterwarnings("ignore:Artifact creation outside:FutureWarning")
def test_a_hung_update_holds_the_runs_end_no_longer_than_the_final_wait(prefect_server, monkeypatch) -> None:
    """The update under way held 3 s, the final wait 0.2 s: the run's end returns while it is still held,
    and raises nothing; the update still lands."""
    monkeypatch.setattr(artifacts_module, "FINAL_UPDATE_WAIT_S", 0.2)

    async def body(gateway: SlowGateway) -> None:
        hub.emit(ProgressEvent("rollouts", done=4, chunk=0))
        await _until(lambda: gateway.holding)

    gateway, shown = asyncio.run(_progress_through(_api(prefect_server), body, hold_s=3.0))
    assert gateway.held_at_end, "the run's end waited for the held update"
    assert shown == 100.0, (shown, gateway.updates)
