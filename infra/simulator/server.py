"""The simulated backend's HTTP side: NeMo Gym agent /run, /v1/responses, /v1/chat/completions, /verify, plus
/health, /metrics (Prometheus text as vLLM or SGLang publish it), /stats (its own counters, JSON) and
/admin/config, and an in-process starter. The generation hot path stays lean (orjson, no logging, cached
content) because the benchmarks drive it at thousands of requests per second on the same cores as the client.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

import orjson
from aiohttp import web

from rollflow.infra.simulator.batching import BatchingEngine
from rollflow.infra.simulator.capacity import Capacity, Counters, Engine, QueueFull
from rollflow.infra.simulator.config import SimConfig
from rollflow.infra.simulator.content import (
    ContentModel,
    chat_object,
    response_text,
    responses_object,
    reward,
)
from rollflow.infra.simulator.exposition import GARBAGE, exposition
from rollflow.infra.simulator.faults import REPLY_FAULTS, Faults
from rollflow.infra.simulator.prefix_cache import PrefixCache

JSON = "application/json"
SIMULATOR_KEY = web.AppKey("simulator", "Simulator")
ROLLOUT_HEADER = "X-Rollflow-Rollout-Index"


def _cache(cfg: SimConfig) -> tuple[int, int, int] | None:
    """The paged cache's (blocks, block size, most tokens a request holds) for cache_config_info."""
    if cfg.kv_blocks is None or cfg.model != "batching":
        return None
    return cfg.kv_blocks, cfg.block_size, cfg.kv_prompt_tokens + cfg.max_tokens


MODEL_FIELDS = {
    "slots": ("slots", "latency_ms", "per_token_ms", "contention"),
    "batching": (
        "max_num_seqs", "step_ms", "seq_step_ms", "kv_tokens", "kv_blocks", "block_size", "kv_prompt_tokens",
        "prefill_tokens", "preempt_after", "recompute",
    ),
}  # fmt: skip


_LONG_DIGITS = re.compile(rb"\d{19}")


def _loads(body: bytes) -> Any:
    """As a Python agent server reads a row: integers beyond 64 bits keep their value (orjson's would not)."""
    value = orjson.loads(body)
    return json.loads(body) if _LONG_DIGITS.search(body) else value


def _json(payload: Any, status: int = 200) -> web.Response:
    try:
        body = orjson.dumps(payload)
    except orjson.JSONEncodeError:
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    return web.Response(body=body, status=status, content_type=JSON)


def _run_seed(params: dict) -> object:
    """A NeMo Gym row's seed: in metadata.extra_body (JSON text), where NeMo Gym's agents take it."""
    metadata = params.get("metadata")
    extra = metadata.get("extra_body") if isinstance(metadata, dict) else None
    try:
        found = json.loads(extra) if isinstance(extra, str) else None
    except ValueError:
        found = None
    return found.get("seed") if isinstance(found, dict) else params.get("seed")


def _bad_request(message: str) -> web.Response:
    return _json({"error": {"message": message, "type": "invalid_request_error"}}, status=400)


def _expected(value: Any) -> str | None:
    return None if value is None else str(value)


class Simulator:
    """Routes plus the shared state: config, capacity, counters, content cache, fault dice."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.counters = Counters()
        self.capacity: Engine = (
            BatchingEngine(config, self.counters)
            if config.model == "batching"
            else Capacity(config, self.counters)
        )
        self.faults = Faults(config, self.counters)
        self.content = ContentModel(
            config.seed,
            config.correct_rate,
            config.min_tokens,
            config.max_tokens,
            (config.difficulty, config.settled_share),
        )
        self.prefix_cache = PrefixCache(config.prefix_cache_prompts, self.counters)

    async def _serve(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        """One generation request: count, parse, maybe fail, queue for a slot, answer deterministically."""
        c = self.counters
        c.requests += 1
        c.endpoints[endpoint] = c.endpoints.get(endpoint, 0) + 1
        try:
            body = _loads(await request.read())
            rollout = int(request.headers.get(ROLLOUT_HEADER, 0))
        except ValueError as exc:
            return _bad_request(f"bad JSON body or {ROLLOUT_HEADER} header: {exc}")
        if not isinstance(body, dict):
            return _bad_request("the body must be a JSON object")
        fault = self.faults.decide()
        if fault is not None and fault not in REPLY_FAULTS:
            return await self.faults.respond(request, fault)
        if endpoint == "run":
            params = body.get("responses_create_params")
            if not isinstance(params, dict):
                return _bad_request("a NeMo Gym row needs a responses_create_params object")
            expected = _expected(body.get("expected_answer"))
            messages, model = params.get("input"), params.get("model")
        else:
            metadata = body.get("metadata")
            expected = _expected(metadata.get("expected_answer")) if isinstance(metadata, dict) else None
            messages = body.get("messages" if endpoint == "chat" else "input")
            model = body.get("model")
        if messages is None:
            return _bad_request("no prompt: expected `input` (Responses) or `messages` (chat)")
        seed = _run_seed(params) if endpoint == "run" else body.get("seed")
        draw = ("seed", seed) if isinstance(seed, int) and not isinstance(seed, bool) else rollout
        made = self.content.get(messages, draw, expected)
        try:
            cached = self.prefix_cache.lookup(messages, self.config.kv_prompt_tokens)
            await self.capacity.serve(made.output_tokens, cached)
        except QueueFull:
            c.faults["queue_full"] = c.faults.get("queue_full", 0) + 1
            return web.Response(status=503, text="over capacity: queue full")
        c.completed += 1
        if endpoint == "chat":
            return _json(chat_object(made, model))
        response = responses_object(made, model)
        if endpoint == "responses":
            return _json(response)
        score = None if fault == "null_reward" else reward(made.text, expected)
        return _json({"responses_create_params": params, "response": response, "reward": score})

    async def run(self, request: web.Request) -> web.StreamResponse:
        """POST /run: a NeMo Gym agent server running the model and its verifier on a whole row."""
        return await self._serve(request, "run")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/responses: the OpenAI Responses API."""
        return await self._serve(request, "responses")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/chat/completions: vLLM / SGLang / OpenAI chat completions."""
        return await self._serve(request, "chat")

    async def verify(self, request: web.Request) -> web.Response:
        """POST /verify: a NeMo Gym resources server scoring a row's `response` against expected_answer."""
        self.counters.endpoints["verify"] = self.counters.endpoints.get("verify", 0) + 1
        try:
            body = _loads(await request.read())
        except ValueError as exc:
            return _bad_request(f"bad JSON body: {exc}")
        if not isinstance(body, dict):
            return _bad_request("the body must be a JSON object")
        return _json({"reward": reward(response_text(body.get("response")), body.get("expected_answer"))})

    async def health(self, request: web.Request) -> web.Response:
        """GET /health: liveness for start-up polling."""
        return _json({"status": "ok"})

    def _in_flight(self) -> int:
        # Handlers whose timers fire in the same tick can overlap for an instant; report the slots the
        # model has busy now, which never exceeds `slots`.
        return min(self.counters.in_flight, self.capacity.busy_now())

    async def stats(self, request: web.Request) -> web.Response:
        """GET /stats: the counters plus the capacity model's name and live settings."""
        cfg = self.config
        counters = asdict(self.counters)
        counters["in_flight"] = self._in_flight()
        model = {name: getattr(cfg, name) for name in MODEL_FIELDS[cfg.model]}
        return _json({**counters, "model": cfg.model, **model, "kv_cache_usage": self.capacity.kv_use()})

    async def metrics(self, request: web.Request) -> web.Response:
        """GET /metrics: an engine's Prometheus gauges (running, waiting, KV cache), or 404 / garbage."""
        cfg = self.config
        if cfg.metrics_format == "none":
            raise web.HTTPNotFound(text="404: Not Found")
        if cfg.metrics_format == "garbage":
            return web.Response(text=GARBAGE, content_type="text/plain")
        text = exposition(
            cfg.metrics_format,
            self._in_flight(),
            self.counters.queued,
            self.capacity.kv_use(),
            self.counters.completed,
            self.capacity.nominal_latency_s(),
            self.counters.preemptions,
            _cache(cfg),
            (self.counters.prefix_queries, self.counters.prefix_hits),
        )
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def reset_stats(self, request: web.Request) -> web.Response:
        """POST /stats/reset: zero the counters (requests under way stay counted as under way)."""
        c = self.counters
        fresh = Counters(in_flight=c.in_flight, queued=c.queued, max_in_flight_seen=c.in_flight + c.queued)
        cfg = self.config
        fresh.max_served_seen = min(c.in_flight, cfg.slots if cfg.model == "slots" else cfg.max_num_seqs)
        c.__dict__.update(fresh.__dict__)
        return _json({"status": "reset"})

    async def admin_config(self, request: web.Request) -> web.Response:
        """POST /admin/config: change live settings (e.g. capacity mid-run); replies the whole config."""
        try:
            self.config.update(orjson.loads(await request.read()))
        except (ValueError, TypeError) as exc:
            return _json({"error": str(exc)}, status=400)
        self.capacity.resize()
        return _json(asdict(self.config))


def build_app(config: SimConfig) -> web.Application:
    """The aiohttp application for `config` (the config object is shared and changed by /admin/config)."""
    sim = Simulator(config)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[SIMULATOR_KEY] = sim
    app.router.add_post("/run", sim.run)
    app.router.add_post("/v1/responses", sim.responses)
    app.router.add_post("/v1/chat/completions", sim.chat)
    app.router.add_post("/verify", sim.verify)
    app.router.add_get("/health", sim.health)
    app.router.add_get("/metrics", sim.metrics)
    app.router.add_get("/stats", sim.stats)
    app.router.add_post("/stats/reset", sim.reset_stats)
    app.router.add_post("/admin/config", sim.admin_config)
    return app


@dataclass
class RunningSimulator:
    """A simulator serving in this process's event loop; close() stops it."""

    url: str
    runner: web.AppRunner

    async def close(self) -> None:
        """Stop listening and drop open connections (hung requests included)."""
        await self.runner.cleanup()


async def start_simulator(config: SimConfig, host: str = "127.0.0.1", port: int = 0) -> RunningSimulator:
    """Serve in the running event loop (for `rollflow demo` and in-process tests); port 0 picks a free one.

    The batching engine aborts a request whose client disconnects, as vLLM does, freeing its sequence.
    """
    runner = web.AppRunner(
        build_app(config),
        access_log=None,
        handle_signals=False,
        shutdown_timeout=0.5,
        handler_cancellation=config.model == "batching",
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=4096)
    await site.start()
    bound = runner.addresses[0][1]
    return RunningSimulator(f"http://{host}:{bound}", runner)
