"""A worker's check of the run's lease: the flow's margin, and storage hiccups that are not a lost lease."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import orjson
import pytest

from rollflow.tasks.storage.lease import Lease, LeaseInfo, LeaseLost, OwnerCheck, follow, owner_fence
from rollflow.tasks.storage.store import Store

pytestmark = pytest.mark.concurrent


def _held(tmp_path: Path, ttl_s: float = 6) -> tuple[Store, Lease]:
    store = Store(str(tmp_path / "out"))
    lease = Lease(store, ttl_s)
    lease.acquire()
    return store, lease


def _expire_in(store: Store, seconds: float) -> None:
    body = orjson.loads(store.read_bytes("lease.json"))
    store.write_bytes("lease.json", orjson.dumps({**body, "expires_at": time.time() + seconds}))


def _unreadable_for(store: Store, seconds: float) -> threading.Thread:
    """The lease object cannot be read for a while (a directory stands where it was), then is back."""
    path = Path(store.root) / "lease.json"
    body = path.read_bytes()
    path.unlink()
    path.mkdir()

    def restore() -> None:
        time.sleep(seconds)
        path.rmdir()
        path.write_bytes(body)

    thread = threading.Thread(target=restore)
    thread.start()
    return thread


def test_a_worker_counts_the_lease_with_the_flows_margin(tmp_path):
    """A lease with less than the flow's margin left is not held for a worker either: the flow stops
    writing at that point, so its workers must too."""
    store, lease = _held(tmp_path)
    fence = owner_fence(store, lease.owner, lease.margin_s)
    fence()
    _expire_in(store, lease.margin_s / 2)
    with pytest.raises(LeaseLost):
        fence()

    async def followed() -> None:
        await asyncio.wait_for(follow(store, lease.owner, 0.05, lease.margin_s), 5)

    with pytest.raises(LeaseLost):
        asyncio.run(followed())


def test_a_lease_read_that_fails_for_a_moment_is_retried(tmp_path):
    store, lease = _held(tmp_path, ttl_s=30)
    fence = owner_fence(store, lease.owner, lease.margin_s)
    _unreadable_for(store, 0.1)
    fence()  # retried until the lease is readable again

    async def follow_through_a_hiccup() -> None:
        watcher = asyncio.create_task(follow(store, lease.owner, 0.05, lease.margin_s))
        await asyncio.sleep(0.2)
        restored = _unreadable_for(store, 1.0)  # longer than a read's retries
        await asyncio.to_thread(restored.join)
        await asyncio.sleep(0.2)
        assert not watcher.done(), watcher.exception()
        _expire_in(store, 0)
        with pytest.raises(LeaseLost):
            await asyncio.wait_for(watcher, 5)

    asyncio.run(follow_through_a_hiccup())


def test_a_lease_that_cannot_be_read_at_all_is_an_error(tmp_path):
    """No good read to go on: the worker cannot tell, and the error says why."""
    store, lease = _held(tmp_path)
    restored = _unreadable_for(store, 2.0)
    try:
        with pytest.raises(IsADirectoryError):
            owner_fence(store, lease.owner, lease.margin_s)()
    finally:
        restored.join()


class LateCheck(OwnerCheck):
    """A worker whose lease read comes back `late_s` after it was made (a busy worker's loop)."""

    late_s = 2.6

    def read(self) -> tuple[LeaseInfo | None, float]:
        got = super().read()
        time.sleep(self.late_s)
        return got


def test_a_renewed_lease_read_late_is_still_held(tmp_path):
    """The run renews every third of the TTL; a read judged by the clock of a late wake-up instead of
    when it was made would count a lease the run holds and renews as lost."""
    store, lease = _held(tmp_path, ttl_s=3)
    check = LateCheck(store, lease.owner, lease.margin_s)
    assert LateCheck.late_s > lease.ttl_s - lease.margin_s - lease.ttl_s / 3  # past a renewal's slack

    async def followed_while_kept() -> None:
        keeper = asyncio.create_task(lease.keep())
        watcher = asyncio.create_task(check.follow(0.05))
        await asyncio.sleep(2 * LateCheck.late_s + 0.5)
        assert not lease.lost, lease.lost_reason
        assert not watcher.done(), watcher.exception()
        for task in (keeper, watcher):
            task.cancel()
        await asyncio.gather(keeper, watcher, return_exceptions=True)

    asyncio.run(followed_while_kept())
