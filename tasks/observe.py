"""Counting every HTTP attempt, retried ones included, so 429s and 5xx that a retry hid still show.

A rollout that succeeds on its third attempt looks fine in the rollout timeline; the two failed attempts
before it are what tells a rate limit or an overloaded backend apart. `AttemptLog.factory()` goes into
`CollectContext.client_factory`; probes read it per step, the adaptive controller per interval.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import ClientSession

from settings import BackendSettings
from tasks.backends import BackendClient, BackendError

ClientFactory = Callable[[BackendSettings, ClientSession], BackendClient]


@dataclass
class AttemptLog:
    """Outcomes of HTTP attempts: successes with their latency, failures by error kind."""

    ok: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)

    def success(self, latency_s: float) -> None:
        self.ok += 1
        self.latencies.append(latency_s)

    def failure(self, kind: str) -> None:
        self.errors[kind] += 1

    def drain_latencies(self) -> list[float]:
        """The latencies seen since the last drain (the adaptive controller's window)."""
        out, self.latencies = self.latencies, []
        return out

    def factory(self, inner: ClientFactory | None = None) -> ClientFactory:
        """A client factory for CollectContext whose clients report here."""
        base = inner or BackendClient

        def make(settings: BackendSettings, session: ClientSession) -> BackendClient:
            client = base(settings, session)
            _observe(client, self)
            return client

        return make


def _observe(client: BackendClient, log: AttemptLog) -> None:
    """Wrap the client's single-attempt call (BackendClient._post) so each attempt is logged."""
    post = client._post

    async def observed(body: bytes, headers: dict[str, str]) -> Any:
        t0 = time.perf_counter()
        try:
            reply = await post(body, headers)
        except BackendError as exc:
            log.failure(exc.kind)
            raise
        log.success(time.perf_counter() - t0)
        return reply

    client._post = observed  # type: ignore[method-assign]


def rate_limited(errors: Counter[str] | dict[str, int]) -> int:
    """How many attempts the backend refused with 429 Too Many Requests."""
    return errors.get("http_429", 0)
