"""Prefect artifacts of a run: a progress bar that moves as chunks commit, a dataset link, the endpoints."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from prefect.artifacts import (
    acreate_link_artifact,
    acreate_progress_artifact,
    acreate_table_artifact,
    aupdate_progress_artifact,
)

from rollflow.tasks.collect.progress import ProgressEvent, hub
from rollflow.tasks.publish.endpoints import ENDPOINT_COLUMNS, endpoint_cells


@contextlib.asynccontextmanager
async def chunk_progress(total_chunks: int, already: int, interval_s: float = 1.0) -> AsyncIterator[None]:
    """Percent of chunks committed, updated at most once per interval (cheap next to a chunk)."""
    done = already
    artifact = await acreate_progress_artifact(
        progress=100.0 * done / max(1, total_chunks), key="rollflow-progress", description="chunks committed"
    )

    def on_event(event: ProgressEvent) -> None:
        nonlocal done
        if event.kind == "chunk":
            done += 1

    async def refresh() -> None:
        shown = -1
        while True:
            if done != shown:
                shown = done
                await aupdate_progress_artifact(artifact, 100.0 * shown / max(1, total_chunks))
            await asyncio.sleep(interval_s)

    unsubscribe = hub.subscribe(on_event)
    task = asyncio.create_task(refresh())
    try:
        yield
    finally:
        unsubscribe()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await aupdate_progress_artifact(artifact, 100.0 * done / max(1, total_chunks))


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
