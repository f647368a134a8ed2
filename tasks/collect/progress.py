"""Progress events from collection to whoever displays them (the CLI bar, Prefect artifacts)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

Listener = Callable[["ProgressEvent"], None]


@dataclass(slots=True)
class ProgressEvent:
    kind: str  # "plan", "rollouts", "chunk"
    total: int = 0
    done: int = 0
    failed: int = 0
    chunk: int | None = None


@dataclass
class ProgressHub:
    """Fan-out of progress events; listeners must be cheap (called from the event loop)."""

    listeners: list[Listener] = field(default_factory=list)
    failed: set[int] = field(default_factory=set)  # listeners whose error was logged already

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener)

    def emit(self, event: ProgressEvent) -> None:
        """A listener's error is logged once and dropped: a display must never fail the chunk emitting."""
        for listener in list(self.listeners):
            try:
                listener(event)
            except Exception:
                if id(listener) not in self.failed:
                    self.failed.add(id(listener))
                    log.warning(
                        "progress listener %r failed; its errors are ignored", listener, exc_info=True
                    )


hub = ProgressHub()
