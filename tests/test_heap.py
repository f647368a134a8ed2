"""The collector keeps start-up objects out of full garbage collections and collects the young generation
less often, once per process."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from tuning_support import setup_run

from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.collect import heap
from rollflow.tasks.collect.chunk import collect_chunk


@pytest.fixture
def unfrozen(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A process state as before any chunk ran, restored afterwards."""
    threshold = gc.get_threshold()
    gc.unfreeze()
    gc.set_threshold(700, *threshold[1:])
    monkeypatch.setitem(heap._state, "done", False)
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def _scanned(obj: object) -> bool:
    """Whether full collections still walk `obj` (frozen objects are in no generation)."""
    return any(o is obj for o in gc.get_objects())


async def test_first_chunk_freezes_startup_objects_and_no_later_ones(tmp_path, simulator, unfrozen) -> None:
    s = setup_run(tmp_path, simulator, rows=40, chunk_size=20)
    first, second = s.plan.scan.chunks
    before = ["alive before the first chunk"]
    assert _scanned(before)
    try:
        await collect_chunk(s.ctx, first)
        after = ["made between the chunks"]
        await collect_chunk(s.ctx, second)
    finally:
        await close_loop_session()
    assert not _scanned(before), "start-up objects are still rescanned by every full collection"
    assert _scanned(after), "a later chunk froze the run's own objects: they could never be freed"
    assert gc.get_threshold()[0] >= heap.YOUNG_THRESHOLD, "a young collection still runs every 700 objects"
    assert s.handles.ledger.manifest(second.index).rows == second.good_rows
