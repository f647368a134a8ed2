"""A chunk attempt that fails (a part write, a stall) ends there: its requests stop and count no more
rollouts, so a retry (or the chunk's abandonment) is not followed by rollouts of the attempt before it;
and what a chunk's progress goes back to when it is abandoned is the earlier commit that stands."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import orjson
import pytest

from rollflow.settings import RollflowSettings, RunSpec
from rollflow.tasks.collect import chunk as chunk_module
from rollflow.tasks.collect.chunk import ChunkStalled, _adoptable, _Flusher
from rollflow.tasks.collect.progress import ProgressEvent, RolloutCount, hub
from rollflow.tasks.collect.rollouts import RolloutBatch
from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.collect.runtime import collect_context, open_run
from rollflow.tasks.storage.ledger import ChunkManifest


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
        assert runner.done(), "the attempt's rollouts run on after it failed"
        at_failure = count.done
        await asyncio.sleep(0.3)
        assert count.done == at_failure < 100, (at_failure, count.done)
    finally:
        unsubscribe()


@pytest.mark.alone  # asserts the stall ends within 3 s
async def test_a_stalled_attempt_whose_check_ignores_cancellation_still_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stall timeout is the last defence against a hung rollout: the attempt is retried even when a
    check swallows the cancellation (it waits RUNNER_STOP_S for it, and says so)."""
    monkeypatch.setattr(chunk_module, "RUNNER_STOP_S", 0.3)
    spec = RunSpec(
        input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out"), backend={"url": "http://127.0.0.1:9"},
        collection={"stall_timeout_s": 0.3},
    )  # fmt: skip
    settings = RollflowSettings()
    ctx = collect_context(open_run(spec, settings), settings, 8)
    release = asyncio.Event()

    async def hung_check() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                continue  # a verifier that catches the cancellation and goes on waiting

    runner = asyncio.create_task(hung_check())
    try:
        t0 = time.monotonic()
        with pytest.raises(ChunkStalled):
            await asyncio.wait_for(_Flusher(ctx, 0, RolloutBatch(), 0).run(runner), 10)
        assert time.monotonic() - t0 < 3, "the stall waited on the check that ignores its cancellation"
    finally:
        release.set()
        runner.cancel()
        await asyncio.wait({runner})


def test_the_floor_of_a_resumed_chunk_is_its_earlier_commit_while_that_stands(tmp_path: Path) -> None:
    """A resumed run redoes a partly failed chunk's failures: abandoned, the chunk goes back to the commit's
    rows and failures, which the dataset keeps; a commit whose data changed is withdrawn by the audit, so
    nothing of it stands."""
    spec = RunSpec(
        input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "out"), backend={"url": "http://127.0.0.1:9"}
    )
    settings = RollflowSettings()
    ctx = collect_context(open_run(spec, settings), settings, 8)
    c = ChunkSpec(index=0, first_task=0, num_tasks=4, good_rows=4, byte_offset=0, first_line=1)
    data = b"".join(
        orjson.dumps({"_ng_task_index": i, "_ng_rollout_index": 0, "reward": 1.0}) + b"\n" for i in range(3)
    )
    manifest = ChunkManifest(
        chunk=0, first_task=0, num_tasks=4, rows_expected=4, rows=3, failed=1,
        sha256="", bytes=0, started_at="", committed_at="", wall_s=0.0, attempt=1,
    )  # fmt: skip
    ctx.ledger.commit(0, data, b'{"_ng_task_index": 3, "error": "boom"}\n', manifest)
    previous = ctx.ledger.manifest(0)
    assert previous is not None
    found = _adoptable(ctx, c, previous)
    assert (found.resumed, found.floor) == (3, (3, 1))
    ctx.ledger.store.write_bytes(ctx.ledger.chunk_path(0), data.replace(b"1.0", b"0.0"))  # changed since
    found = _adoptable(ctx, c, previous)
    assert (found.resumed, found.floor) == (0, (0, 0)), found.problems
