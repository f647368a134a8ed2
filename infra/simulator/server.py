"""The simulated backend: NeMo Gym agent /run, /v1/responses, /v1/chat/completions and /verify."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import sys
from dataclasses import asdict, dataclass
from typing import Any

import orjson
from aiohttp import web

from infra.simulator.capacity import Capacity, Counters, QueueFull
from infra.simulator.config import SimConfig, parse_fault_kinds
from infra.simulator.content import chat_object, completion, responses_object

JSON = "application/json"


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type=JSON)


class Simulator:
    """Routes plus the shared state: config, capacity, counters, fault dice."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.counters = Counters()
        self.capacity = Capacity(config, self.counters)
        self.rng = random.Random(config.seed)

    def _fault(self) -> str | None:
        cfg = self.config
        if cfg.fault_rate <= 0 or not cfg.fault_kinds or self.rng.random() >= cfg.fault_rate:
            return None
        kind = self.rng.choice(cfg.fault_kinds)
        self.counters.faults[kind] = self.counters.faults.get(kind, 0) + 1
        return kind

    async def _inject(self, request: web.Request, kind: str) -> web.StreamResponse:
        if kind == "429":
            return web.Response(
                status=429, text="rate limited", headers={"Retry-After": f"{self.config.retry_after_s:g}"}
            )
        if kind in ("500", "503"):
            return web.Response(status=int(kind), text=f"injected {kind}")
        if kind == "malformed":
            return web.Response(body=b'{"id": "resp_trunc", "output": [', content_type=JSON)
        if kind == "hang":
            await asyncio.sleep(self.config.hang_s)
            return web.Response(status=504, text="hung")
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError("injected reset")

    async def _serve(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        c = self.counters
        c.requests += 1
        c.endpoints[endpoint] = c.endpoints.get(endpoint, 0) + 1
        body = orjson.loads(await request.read())
        fault = self._fault()
        if fault is not None:
            return await self._inject(request, fault)
        rollout = int(request.headers.get("X-Rollflow-Rollout-Index", "0"))
        cfg = self.config
        if endpoint == "run":
            params = body.get("responses_create_params") or {}
            expected = body.get("expected_answer")
        elif endpoint == "chat":
            params = {"input": body.get("messages"), "model": body.get("model")}
            expected = (body.get("metadata") or {}).get("expected_answer")
        else:
            params = body
            expected = (body.get("metadata") or {}).get("expected_answer")
        messages = params.get("input")
        text, out_tok, in_tok, ident = completion(
            messages, rollout, cfg.seed, None if expected is None else str(expected),
            cfg.correct_rate, cfg.min_tokens, cfg.max_tokens,
        )  # fmt: skip
        try:
            await self.capacity.serve(out_tok)
        except QueueFull:
            self.counters.faults["queue_full"] = self.counters.faults.get("queue_full", 0) + 1
            return web.Response(status=503, text="over capacity: queue full")
        c.completed += 1
        model = params.get("model")
        if endpoint == "chat":
            return _json(chat_object(text, out_tok, in_tok, ident, model))
        response = responses_object(text, out_tok, in_tok, ident, model)
        if endpoint == "responses":
            return _json(response)
        reward = 1.0 if expected is not None and text.endswith(f"\\boxed{{{expected}}}") else 0.0
        return _json({"responses_create_params": params, "response": response, "reward": reward})

    async def run(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "run")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "responses")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def verify(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        expected = body.get("expected_answer")
        text = ""
        for item in (body.get("response") or {}).get("output") or ():
            for part in item.get("content") or ():
                text += part.get("text", "")
        ok = expected is not None and text.rstrip().endswith(f"\\boxed{{{expected}}}")
        return _json({"reward": 1.0 if ok else 0.0})

    async def health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        return _json(
            {**asdict(self.counters), "slots": self.config.slots, "latency_ms": self.config.latency_ms}
        )

    async def reset_metrics(self, request: web.Request) -> web.Response:
        fresh = Counters(in_flight=self.counters.in_flight, queued=self.counters.queued)
        self.counters.__dict__.update(fresh.__dict__)
        return _json({"status": "reset"})

    async def admin_config(self, request: web.Request) -> web.Response:
        try:
            self.config.update(orjson.loads(await request.read()))
        except (ValueError, TypeError) as exc:
            return _json({"error": str(exc)}, status=400)
        self.capacity.resize()
        return _json(asdict(self.config))


def build_app(config: SimConfig) -> web.Application:
    sim = Simulator(config)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app["simulator"] = sim
    app.router.add_post("/run", sim.run)
    app.router.add_post("/v1/responses", sim.responses)
    app.router.add_post("/v1/chat/completions", sim.chat)
    app.router.add_post("/verify", sim.verify)
    app.router.add_get("/health", sim.health)
    app.router.add_get("/metrics", sim.metrics)
    app.router.add_post("/metrics/reset", sim.reset_metrics)
    app.router.add_post("/admin/config", sim.admin_config)
    return app


@dataclass
class RunningSimulator:
    url: str
    runner: web.AppRunner

    async def close(self) -> None:
        await self.runner.cleanup()


async def start_simulator(config: SimConfig, host: str = "127.0.0.1", port: int = 0) -> RunningSimulator:
    """Serve in the running event loop (for `rollflow demo` and in-process tests)."""
    runner = web.AppRunner(build_app(config), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    bound = runner.addresses[0][1]
    return RunningSimulator(f"http://{host}:{bound}", runner)


def make_parser() -> argparse.ArgumentParser:
    d = SimConfig()
    p = argparse.ArgumentParser(prog="rollflow simulate", description="The simulated inference backend.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--slots", type=int, default=d.slots, help="requests served at once; the rest queue FIFO")
    p.add_argument("--latency-ms", type=float, default=d.latency_ms, help="base service time")
    p.add_argument("--per-token-ms", type=float, default=d.per_token_ms, help="added per output token")
    p.add_argument("--contention", type=float, default=d.contention, help="service-time growth with load")
    p.add_argument(
        "--jitter", type=float, default=d.jitter, help="service time varies uniformly by +-this fraction"
    )
    p.add_argument("--max-queue", type=int, default=None, help="beyond this many waiting, answer 503")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--correct-rate", type=float, default=d.correct_rate)
    p.add_argument(
        "--fault-rate", type=float, default=d.fault_rate, help="probability of a fault per request"
    )
    p.add_argument("--fault-kinds", default=",".join(d.fault_kinds), help="429,500,503,reset,hang,malformed")
    p.add_argument("--retry-after-s", type=float, default=d.retry_after_s)
    p.add_argument("--hang-s", type=float, default=d.hang_s)
    p.add_argument("--min-tokens", type=int, default=d.min_tokens)
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        slots=args.slots, latency_ms=args.latency_ms, per_token_ms=args.per_token_ms,
        contention=args.contention, jitter=args.jitter, max_queue=args.max_queue, seed=args.seed,
        correct_rate=args.correct_rate, fault_rate=args.fault_rate,
        fault_kinds=parse_fault_kinds(args.fault_kinds), retry_after_s=args.retry_after_s,
        hang_s=args.hang_s, min_tokens=args.min_tokens, max_tokens=args.max_tokens,
    )  # fmt: skip


async def _serve_forever(config: SimConfig, host: str, port: int) -> None:
    sim = await start_simulator(config, host, port)
    print(f"rollflow simulator listening on {sim.url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await sim.close()


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"rollflow simulate: {exc}", file=sys.stderr)
        return 2
    asyncio.run(_serve_forever(config, args.host, args.port))
    return 0
