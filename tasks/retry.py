"""Backoff policy: exponential with full jitter, honouring Retry-After."""

from __future__ import annotations

import random
from dataclasses import dataclass

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_retries: int
    base_s: float
    max_s: float

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number `attempt` (0-based)."""
        if retry_after is not None:
            return min(self.max_s, retry_after) + random.uniform(0, min(0.25, self.base_s))
        return random.uniform(0, min(self.max_s, self.base_s * (2**attempt)))


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After in seconds; the HTTP-date form is ignored (the normal backoff applies)."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None
