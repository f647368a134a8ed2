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
from rollflow.tasks.collect.progress import ProgressEvent, RolloutCount, hub, resume_text


class Notes:
    """What a run says between its start and its progress, with or without the bar: that it resumes (and
    how much is there), and what it is doing before its first rollouts (a `stage` event's text)."""

    def __init__(self, console: Console, stages: bool = True) -> None:
        self.console = console
        self.stages = stages
        self._unsubscribe = lambda: None

    def _on_event(self, event: ProgressEvent) -> None:
        if event.kind == "forecast":  # a figure, not a note: its own line, without the notes' prefix
            self.console.print(event.text, highlight=False, soft_wrap=True)
            return
        if event.kind == "resume":
            said = resume_text(event.done, event.total)
        elif event.kind == "stage" and self.stages:
            said = event.text
        else:
            return
        self.console.print(f"rollflow: {said}", highlight=False, soft_wrap=True)

    def __enter__(self) -> Notes:
        self._unsubscribe = hub.subscribe(self._on_event)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._unsubscribe()


class ProgressBar:
    """Counts events on the event loop (cheap) and redraws from rich's own refresh thread."""

    def __init__(self, console: Console, enabled: bool = True, verb: str = "collect") -> None:
        self.console = console
        self.enabled = enabled
        self.count = RolloutCount()
        self._lock = threading.Lock()
        self._progress = Progress(
            TextColumn(f"[bold]{verb}"),
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
        if self.enabled:  # a bar not shown counts nothing: every rollout's event would pass it for naught
            self._unsubscribe = hub.subscribe(self._on_event)
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


def run_started(spec: RunSpec) -> str:
    """A run's first progress line: where it writes, what it asks, what it reads."""
    backend = spec.backend
    where = (
        f"agents found through NeMo Gym's head server {backend.head_server}"
        if backend.head_server and not backend.agents
        else backend.url
    )
    return f"run started: output {spec.output}, backend {backend.kind.value} {where}, input {spec.input}"


class ProgressLines:
    """Plain lines for logs (stderr not a terminal): the start, the plan, then every 10 s or 5% done.

    `spec` (a run) or `start` (another command's first line) says what started; `verb` what the count
    is of (collect, rescore)."""

    def __init__(
        self,
        spec: RunSpec | None,
        enabled: bool = True,
        every_s: float = 10.0,
        steps: int = 20,
        start: str = "",
        verb: str = "collect",
    ) -> None:
        self.spec, self.enabled, self.every_s, self.steps = spec, enabled, every_s, steps
        self.start = start or (run_started(spec) if spec is not None else "")
        self.verb = verb
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
                f"{self.verb} {finished:,}/{total:,} rollouts ({share:.0%}), {rate:,.1f} rollouts/s, "
                f"failed {count.failed:,}{workers}, elapsed {elapsed:,.0f} s{eta}"
            )

    def _tick(self) -> None:
        while not self._stop.wait(self.every_s):
            if self.count.total:
                self._line()

    def __enter__(self) -> ProgressLines:
        if self.enabled:
            if self.start:
                self._say(self.start)
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
