"""What a chunk run in another process (a Dask or Ray worker) gets besides its spec.

A worker needs only what travels in the spec (output URI, backend URL) plus its own environment
(storage credentials, API key, or the Secret blocks they name). A cancelled Dask or Ray future does not
stop a running task, so the worker itself stops the chunk at the run's deadline or when the run's lease
is gone.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rollflow.settings import RollflowSettings

SettingsResolver = Callable[[RollflowSettings], Awaitable[RollflowSettings]]


@dataclass(frozen=True)
class WorkerScope:
    """What bounds a chunk on a worker: the run's deadline (epoch seconds) and the run's lease owner, whose
    lease counts as held only with more than `margin_s` left (the flow's own margin)."""

    stop_at: float | None = None
    owner: str | None = None
    check_s: float = 1.0
    margin_s: float = 0.0
