"""Fault injection: each generation request independently, with probability fault_rate, fails in one of the
configured ways, chosen uniformly. Decided before the request takes a capacity slot, so a hung request
holds no slot. The dice are a random.Random(seed): reproducible in one process, not across runs.
"""

from __future__ import annotations

import asyncio
import random

from aiohttp import web

from rollflow.infra.simulator.capacity import Counters
from rollflow.infra.simulator.config import SimConfig

MALFORMED_BODY = b'{"id": "resp_trunc", "object": "response", "output": ['
ERROR_OBJECT = b'{"error": {"message": "injected error object", "type": "server_error", "code": 500}}'
# Faults that shape an otherwise normal reply instead of replacing it.
REPLY_FAULTS = ("null_reward",)


class Faults:
    """Rolls the dice per request and produces the chosen failure."""

    def __init__(self, config: SimConfig, counters: Counters) -> None:
        self.config = config
        self.counters = counters
        self.rng = random.Random(config.seed)

    def decide(self) -> str | None:
        """The fault kind for this request, or None (the common, cheap case when fault_rate is 0)."""
        cfg = self.config
        if cfg.fault_rate <= 0 or not cfg.fault_kinds or self.rng.random() >= cfg.fault_rate:
            return None
        kind = self.rng.choice(cfg.fault_kinds)
        self.counters.faults[kind] = self.counters.faults.get(kind, 0) + 1
        return kind

    async def respond(self, request: web.Request, kind: str) -> web.StreamResponse:
        """The failure as the client sees it: a status, a dropped connection, silence, or broken JSON."""
        if kind == "429":
            headers = {"Retry-After": f"{self.config.retry_after_s:g}"}
            return web.Response(status=429, text="rate limited (injected)", headers=headers)
        if kind in ("500", "503"):
            return web.Response(status=int(kind), text=f"injected {kind}")
        if kind == "malformed":
            return web.Response(body=MALFORMED_BODY, content_type="application/json")
        if kind == "error_object":
            return web.Response(body=ERROR_OBJECT, content_type="application/json")
        if kind == "hang":
            # The client's timeout ends it; if it never does, answer 504 after hang_s.
            await asyncio.sleep(self.config.hang_s)
            return web.Response(status=504, text="hung (injected)")
        # reset: drop the TCP connection without a reply. aiohttp then fails to write the response
        # below with a ConnectionError, which it handles quietly (no traceback per injected reset).
        if request.transport is not None:
            request.transport.abort()
        return web.Response(status=500, text="reset (injected)")
