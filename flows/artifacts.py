"""Prefect artifacts of a run: a progress bar that moves as rollouts finish, a dataset link, the endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from prefect.artifacts import (
    acreate_link_artifact,
    acreate_progress_artifact,
    acreate_table_artifact,
    aupdate_progress_artifact,
)

from rollflow.settings import redact
from rollflow.tasks.collect.progress import RolloutCount, hub
from rollflow.tasks.publish.endpoints import ENDPOINT_COLUMNS, endpoint_cells

log = logging.getLogger(__name__)
FINAL_UPDATE_WAIT_S = 10.0  # the run's end waits this long at most for the bar's last updates (with retries)


@contextlib.asynccontextmanager
async def rollout_progress(total: int, interval_s: float = 1.0) -> AsyncIterator[None]:
    """Percent of the `total` planned rollouts finished, counted as they finish (on workers too, from
    their reports), updated at most once per interval and once more as the run ends."""
    count = RolloutCount(total=total)
    artifact = await acreate_progress_artifact(
        progress=0.0, key="rollflow-progress", description="planned rollouts finished"
    )

    def percent() -> float:
        return 100.0 * count.finished / count.total if count.total else 0.0

    async def refresh() -> None:
        """The only writer once the bar exists, one update at a time: an update cancelled mid-request
        could still reach the server after the final one and set the bar back. The last pass starts
        after the run ended, so it shows the final count; a failed update is logged, not raised (one
        that failed on this side, e.g. a read timeout, may still reach the server later: artifacts
        carry no version to refuse it)."""
        shown, warned = 0.0, False
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), interval_s)
            final = ended.is_set()
            value = percent()
            if value != shown:
                try:
                    await aupdate_progress_artifact(artifact, value)
                    shown = value
                except Exception as exc:
                    if not warned:
                        log.warning("the progress artifact was not updated: %s: %s", type(exc).__name__, exc)
                        warned = True
            if final:
                return

    ended = asyncio.Event()
    logged = RunLines(count)
    unsubscribe = hub.subscribe(count.add)
    task = asyncio.create_task(refresh())
    lines = asyncio.create_task(logged.every(interval_s * 10, ended))
    try:
        yield
    finally:
        unsubscribe()
        ended.set()
        await _last_update(task)
        await _last_update(lines)


class RunLines:
    """The run's progress as lines in its Prefect logs (the UI's Logs tab): every `every_s` while rollouts
    finish, and once at the end; redacted like every other text rollflow writes."""

    def __init__(self, count: RolloutCount) -> None:
        self.count, self.t0 = count, time.monotonic()

    def line(self) -> str:
        c, elapsed = self.count, time.monotonic() - self.t0
        share = c.finished / c.total if c.total else 0.0
        rate = c.done / elapsed if elapsed > 0 else 0.0
        return (
            f"collect {c.finished:,}/{c.total:,} rollouts ({share:.0%}), {rate:,.1f} rollouts/s, "
            f"failed {c.failed:,}, elapsed {elapsed:,.0f} s"
        )

    async def every(self, every_s: float, ended: asyncio.Event) -> None:
        shown = -1
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), every_s)
            if self.count.finished != shown or ended.is_set():
                shown = self.count.finished
                run_log(self.line())
            if ended.is_set():
                return


def run_log(text: str, level: int = logging.INFO) -> None:
    """One line in the flow run's Prefect logs, redacted; nothing outside a run (a worker process)."""
    from prefect.exceptions import MissingContextError
    from prefect.logging import get_run_logger

    with contextlib.suppress(MissingContextError):
        get_run_logger().log(level, redact.redact(text))


async def _last_update(task: asyncio.Task[None]) -> None:
    """Wait for the bar's last update, at most FINAL_UPDATE_WAIT_S: a Prefect API that hangs must not hold
    the run's end. `asyncio.wait` neither raises the task's outcome in place of the run's own nor
    swallows a cancellation of the run that arrives meanwhile (as `wait_for` can)."""
    try:
        done, _ = await asyncio.wait({task}, timeout=FINAL_UPDATE_WAIT_S)
    finally:
        if not task.done():
            task.cancel()  # hung, or the run is being cancelled: the last update is dropped
    if not done:
        log.warning("the progress artifact's last update did not end within %.0f s", FINAL_UPDATE_WAIT_S)


async def dataset_link(url: str) -> None:
    link = url if "://" in url else Path(url).resolve().as_uri()
    await acreate_link_artifact(
        link, link_text=url, key="rollflow-dataset", description="the published dataset"
    )


async def endpoints_table(rows: list[dict[str, Any]]) -> None:
    """The report's endpoint table as a Prefect table artifact, with the cells report.md shows."""
    if rows:
        table = [dict(zip(ENDPOINT_COLUMNS, endpoint_cells(row), strict=True)) for row in rows]
        await acreate_table_artifact(table, key="rollflow-endpoints", description="requests per endpoint")
