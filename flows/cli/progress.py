"""A live progress bar (rollouts/s, ETA, failures) fed by rollflow.tasks.collect.progress events."""

from __future__ import annotations

import threading
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from rollflow.tasks.collect.progress import ProgressEvent, hub


class ProgressBar:
    """Counts events on the event loop (cheap) and redraws from rich's own refresh thread."""

    def __init__(self, console: Console, enabled: bool = True) -> None:
        self.console = console
        self.enabled = enabled
        self.total = 0
        self.done = 0
        self.failed = 0
        self._lock = threading.Lock()
        self._progress = Progress(
            TextColumn("[bold]collect"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]} rollouts/s"),
            TextColumn("failed {task.fields[failed]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            refresh_per_second=4,
            transient=False,
            disable=not enabled,
        )
        self._task = self._progress.add_task("collect", total=None, rate="-", failed=0)
        self._unsubscribe = lambda: None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, daemon=True)

    def _on_event(self, event: ProgressEvent) -> None:
        if event.kind == "rollouts":
            self.done += event.done
            self.failed += event.failed
        elif event.kind == "plan":
            self.total = event.total

    def _refresh(self) -> None:
        while not self._stop.wait(0.25):
            self._update()

    def _update(self) -> None:
        task = self._progress.tasks[0]
        elapsed = task.elapsed or 0.0
        rate = f"{self.done / elapsed:,.0f}" if elapsed > 0 else "-"
        self._progress.update(
            self._task,
            total=self.total or None,
            completed=self.done + self.failed,
            rate=rate,
            failed=self.failed,
        )

    def __enter__(self) -> ProgressBar:
        self._unsubscribe = hub.subscribe(self._on_event)
        if self.enabled:
            self._progress.start()
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._unsubscribe()
        if self.enabled:
            self._stop.set()
            self._thread.join()
            self._update()
            self._progress.stop()
