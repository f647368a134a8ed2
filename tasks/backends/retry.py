"""Backoff policy: exponential with full jitter, honouring Retry-After on every retryable status.

Retryable: connection errors, timeouts, HTTP 429/500/502/503/504 and a 2xx body that is not JSON. A
Retry-After (seconds or an HTTP date) on any of those statuses sets the wait, capped by backoff_max_s.
Any other 4xx fails the rollout at once: repeating a request the backend rejected only wastes its time.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from rollflow.settings import BackendParams

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
RETRY_AFTER_JITTER_S = 0.25


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_retries: int
    base_s: float
    max_s: float

    @classmethod
    def from_settings(cls, settings: BackendParams) -> RetryPolicy:
        return cls(settings.max_retries, settings.backoff_base_s, settings.backoff_max_s)

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number `attempt` (0-based).

        Full jitter spreads a burst of failed requests so they do not come back in lockstep; a server's
        Retry-After wins (capped by max_s) with a little jitter for the same reason.
        """
        if retry_after is not None:
            return min(self.max_s, retry_after) + random.uniform(0, min(RETRY_AFTER_JITTER_S, self.base_s))
        return random.uniform(0, min(self.max_s, self.base_s * (2 ** min(attempt, 62))))


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After in seconds, from either of its forms (seconds, or an HTTP date); None if unreadable."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    return max(0.0, seconds) if seconds == seconds else None  # NaN is not a delay
