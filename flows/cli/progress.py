"""Progress fed by rollflow.tasks.collect.progress events: a live bar on a terminal, plain lines in logs."""

from __future__ import annotations

import sys
import threading
import time
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

from rollflow.settings import RunSpec
from rollflow.tasks.collect.progress import ProgressEvent, RolloutCount, hub


class ProgressBar:
    """Counts events on the event loop (cheap) and redraws from rich's own refresh thread."""

    def __init__(self, console: Console, enabled: bool = True) -> None:
        self.console = console
        self.enabled = enabled
        self.count = RolloutCount()
        self._lock = threading.Lock()
        self._progress = Progress(
            TextColumn("[bold]collect"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]} rollouts/s"),
            TextColumn("failed {task.fields[failed]}"),
            TextColumn("{task.fields[workers]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            refresh_per_second=4,
            transient=False,
            disable=not enabled,
        )
        self._task = self._progress.add_task("collect", total=None, rate="-", failed=0, workers="")
        self._unsubscribe = lambda: None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh, daemon=True)

    def _on_event(self, event: ProgressEvent) -> None:
        self.count.add(event)

    def _refresh(self) -> None:
        while not self._stop.wait(0.25):
            self._update()

    def _update(self) -> None:
        task, count = self._progress.tasks[0], self.count
        elapsed = task.elapsed or 0.0
        rate = f"{count.done / elapsed:,.0f}" if elapsed > 0 else "-"
        self._progress.update(
            self._task,
            total=count.total or None,
            completed=count.finished,
            rate=rate,
            failed=count.failed,
            workers=f"{count.workers} workers" if count.workers else "",
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


class ProgressLines:
    """Plain lines for logs (stderr not a terminal): the start, the plan, then every 10 s or 5% done."""

    def __init__(self, spec: RunSpec, enabled: bool = True, every_s: float = 10.0, steps: int = 20) -> None:
        self.spec, self.enabled, self.every_s, self.steps = spec, enabled, every_s, steps
        self.count = RolloutCount()
        self.shown = 0
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._unsubscribe = lambda: None

    def _say(self, text: str) -> None:
        sys.stderr.write(f"rollflow: {text}\n")
        sys.stderr.flush()

    def _on_event(self, event: ProgressEvent) -> None:
        count = self.count
        if not count.add(event):
            return
        if event.kind == "plan":
            self.t0 = time.monotonic()
            self._say(f"{event.total:,} rollouts planned")
        elif count.total and count.finished * self.steps // count.total > self.shown:
            self._line()

    def _line(self) -> None:
        with self._lock:
            count, elapsed = self.count, time.monotonic() - self.t0
            finished, total = count.finished, count.total
            share = finished / total if total else 0.0
            self.shown = finished * self.steps // total if total else 0
            rate = count.done / elapsed if elapsed > 0 else 0.0
            eta = f", ETA {max(0, total - finished) / rate:,.0f} s" if rate > 0 and total else ""
            workers = f", {count.workers} workers" if count.workers else ""
            self._say(
                f"collect {finished:,}/{total:,} rollouts ({share:.0%}), {rate:,.1f} rollouts/s, "
                f"failed {count.failed:,}{workers}, elapsed {elapsed:,.0f} s{eta}"
            )

    def _tick(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.count.total:
                self._line()

    def __enter__(self) -> ProgressLines:
        if self.enabled:
            spec = self.spec
            backend = spec.backend
            where = (
                f"agents found through NeMo Gym's head server {backend.head_server}"
                if backend.head_server and not backend.agents
                else backend.url
            )
            self._say(
                f"run started: output {spec.output}, backend {backend.kind.value} {where}, input {spec.input}"
            )
            self._unsubscribe = hub.subscribe(self._on_event)
            self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._unsubscribe()
        if self.enabled:
            self._stop.set()
            self._thread.join()
