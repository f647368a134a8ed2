"""Counting every HTTP attempt, retried ones included, so 429s and 5xx that a retry hid still show.

A rollout that succeeds on its third attempt looks fine in the rollout timeline; the two failed attempts
before it are what tells a rate limit or an overloaded backend apart. An AttemptLog goes into
`CollectContext.observers`; probes read it per step, the adaptive controller per interval.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol


class AttemptObserver(Protocol):
    """Sees every HTTP attempt, retried ones included (diagnosis and adaptive mode count 429s here)."""

    def success(self, latency_s: float) -> None: ...

    def failure(self, kind: str) -> None: ...


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


def rate_limited(errors: Counter[str] | dict[str, int]) -> int:
    """How many attempts the backend refused with 429 Too Many Requests."""
    return errors.get("http_429", 0)
