"""Progress events from collection to whoever displays them (the CLI bar, Prefect artifacts)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        self.listeners.append(listener)
        return lambda: self.listeners.remove(listener)

    def emit(self, event: ProgressEvent) -> None:
        for listener in self.listeners:
            listener(event)


hub = ProgressHub()
