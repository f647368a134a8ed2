"""A chunk attempt whose part write fails ends there: its requests stop and count no more rollouts, so a
retry (or the chunk's abandonment) is not followed by rollouts of the attempt before it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rollflow.settings import RollflowSettings, RunSpec
from rollflow.tasks.collect.chunk import _Flusher
from rollflow.tasks.collect.progress import ProgressEvent, RolloutCount, hub
from rollflow.tasks.collect.rollouts import RolloutBatch
from rollflow.tasks.collect.runtime import collect_context, open_run


async def test_a_failed_part_write_stops_the_attempts_rollouts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    spec = RunSpec(
        input=str(tmp_path / "in.jsonl"), output=str(out), backend={"url": "http://127.0.0.1:9"},
        collection={"flush_interval_s": 0.05},
    )  # fmt: skip
    settings = RollflowSettings()
    ctx = collect_context(open_run(spec, settings), settings, 8)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parts").write_text("a file where the parts' folder goes: every part write fails\n")
    batch, count = RolloutBatch(), RolloutCount(total=100)
    unsubscribe = hub.subscribe(count.add)

    async def rollouts() -> None:  # as run_rollouts: a result, then its progress event
        for i in range(100):
            await asyncio.sleep(0.01)
            batch.results[(i, 0)] = b'{"reward": 1.0}'
            hub.emit(ProgressEvent("rollouts", chunk=0, done=1))

    try:
        runner = asyncio.create_task(rollouts())
        with pytest.raises(OSError):
            await _Flusher(ctx, 0, batch, 0).run(runner)
        at_failure = count.done
        await asyncio.sleep(0.3)
        assert runner.done(), "the attempt's rollouts run on after it failed"
        assert count.done == at_failure < 100, (at_failure, count.done)
    finally:
        unsubscribe()
