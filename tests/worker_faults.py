"""A Dask worker preload for tests (`--preload worker_faults`, with tests/ on the workers' PYTHONPATH): the
worker process is killed outright (SIGKILL) whenever chunk 0 starts on it, after appending its pid to the
file ROLLFLOW_TEST_DEATHS names."""

from __future__ import annotations

import os
import signal
from typing import Any

from rollflow.tasks.scaleout import collector

_collect_chunk = collector.collect_chunk


async def _dies_on_chunk_0(ctx: Any, chunk: Any, attempt: int = 1) -> Any:
    if chunk.index == 0:
        with open(os.environ["ROLLFLOW_TEST_DEATHS"], "a") as deaths:
            deaths.write(f"{os.getpid()}\n")
        os.kill(os.getpid(), signal.SIGKILL)
    return await _collect_chunk(ctx, chunk, attempt)


def dask_setup(worker: Any) -> None:
    collector.collect_chunk = _dies_on_chunk_0
