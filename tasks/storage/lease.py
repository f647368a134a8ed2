"""One writer per output: a lease object (owner, host, expiry) renewed while the run lives.

On S3 the lease is taken with conditional writes (If-None-Match to create, If-Match on the ETag to renew
or take over), so two runs cannot both win. On a local disk the read-check-write happens under flock.
Other fsspec stores get a documented best effort: write, then read back and check the owner.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import orjson

from rollflow.tasks.storage.cas import ObjectCas
from rollflow.tasks.storage.store import Store

LEASE = "lease.json"
T = TypeVar("T")


class LeaseHeld(Exception):
    """Another live run holds the output."""


class LeaseLost(Exception):
    """Our lease was taken over (we were presumed dead); this run must stop writing."""


@dataclass
class LeaseInfo:
    owner: str
    host: str
    pid: int
    acquired_at: float
    expires_at: float

    def owner_alive_here(self) -> bool:
        """False only when the owner is a process of this host that no longer exists."""
        if self.host != socket.gethostname():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _parse(data: bytes | None) -> LeaseInfo | None:
    if not data:
        return None
    try:
        return LeaseInfo(**orjson.loads(data))
    except (orjson.JSONDecodeError, TypeError):
        return None


class Lease:
    """This run's claim on the output."""

    def __init__(self, store: Store, ttl_s: float) -> None:
        self.cas = ObjectCas(store, LEASE)
        self.store = store
        self.ttl_s = ttl_s
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.owner = f"{self.host}:{self.pid}:{secrets.token_hex(4)}"
        self.token: str | None = None
        self.acquired_at = time.time()
        self.lost = False
        self.lost_reason = ""
        self.margin_s = ttl_s / 6
        self.valid_until = time.monotonic() + ttl_s - self.margin_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollflow-lease")

    def _body(self) -> bytes:
        info = LeaseInfo(self.owner, self.host, self.pid, self.acquired_at, time.time() + self.ttl_s)
        return orjson.dumps(asdict(info))

    def _held_message(self, info: LeaseInfo) -> str:
        return (
            f"The output {self.store.root_url} is in use by another rollflow run (pid {info.pid} on "
            f"{info.host}, since {_stamp(info.acquired_at)}); its lease runs until {_stamp(info.expires_at)} "
            f"and is renewed while that run lives. Wait for it to finish, or use another --output. If that "
            f"run is dead, its lease expires by then and the next run takes over; nothing is lost either way."
        )

    def acquire(self) -> None:
        for _ in range(3):
            started = time.monotonic()
            data, token = self.cas.read()
            info = _parse(data)
            live = info is not None and info.expires_at > time.time() and info.owner_alive_here()
            if info is not None and info.owner != self.owner and live:
                raise LeaseHeld(self._held_message(info))
            body = self._body()
            if self.cas.write(body, token if data is not None else None):
                self.token = self.cas.read()[1]
                self.valid_until = started + self.ttl_s - self.margin_s
                return
        data, _ = self.cas.read()
        info = _parse(data)
        raise LeaseHeld(
            self._held_message(info) if info else f"The output {self.store.root_url} is contended."
        )

    def renew(self) -> None:
        data, token = self.cas.read()
        info = _parse(data)
        if info is None or info.owner != self.owner or not self.cas.write(self._body(), token):
            self._lose(
                f"This run's lease on {self.store.root_url} was taken over by "
                f"{info.owner if info else 'nobody'}; this run stopped writing so that only one run writes "
                f"the output. Everything it committed is kept."
            )
            raise LeaseLost(self.lost_reason)

    def release(self) -> None:
        with contextlib.suppress(Exception):
            info = _parse(self.cas.read()[0])
            if info is not None and info.owner == self.owner:
                self.cas.delete()
        self._pool.shutdown(wait=False)

    def _lose(self, reason: str) -> None:
        self.lost = True
        self.lost_reason = reason

    async def _renew_within(self, budget_s: float) -> float:
        """Renew on the lease's own thread; the monotonic start time of a renewal that succeeded in time."""
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(loop.run_in_executor(self._pool, self.renew), timeout=max(0.0, budget_s))
        return started

    async def keep(self, on_lost: Callable[[], None] | None = None) -> None:
        """Renew every third of the TTL until the lease is lost, then call `on_lost` and return.

        Lost means taken over, or not renewed in time: once now reaches the last good renewal + TTL -
        margin, the stored lease may expire before this run stops, so the run must stop first.
        """
        while not self.lost:
            now = time.monotonic()
            await asyncio.sleep(max(0.0, min(self.ttl_s / 3, self.valid_until - now)))
            now = time.monotonic()
            if now >= self.valid_until:
                self._lose(self._expired_message())
                break
            try:
                started = await self._renew_within(self.valid_until - now)
                self.valid_until = started + self.ttl_s - self.margin_s
            except LeaseLost as exc:
                self._lose(str(exc))
            except TimeoutError:
                self._lose(self._expired_message())
            except Exception:  # a storage hiccup: try again, until the lease could expire
                continue
        if on_lost is not None:
            on_lost()

    def check(self) -> None:
        """Raise LeaseLost unless this run surely still holds the lease (the ledger's commit fence)."""
        if not self.lost and time.monotonic() >= self.valid_until:
            self._lose(self._expired_message())
        if self.lost:
            raise LeaseLost(self.lost_reason)

    def _expired_message(self) -> str:
        return (
            f"This run could not renew its lease on {self.store.root_url} within its {self.ttl_s:g}s "
            f"lifetime (storage unreachable, or the process too busy), so another run may take the output "
            f"over: this run stopped writing. Everything it committed is kept; run the same command again "
            f"to resume."
        )

    async def guard(self, work: Coroutine[Any, Any, T]) -> T:
        """Run `work` while the lease is kept; if it is lost, `work` (and every task it started inside
        a task group) is cancelled and awaited before LeaseLost is raised, so no writer outlives it."""

        async def keeper() -> None:
            await self.keep()
            raise LeaseLost(self.lost_reason)

        return await run_guarded(work, keeper())


async def run_guarded(work: Coroutine[Any, Any, T], watcher: Coroutine[Any, Any, None]) -> T:
    """`work`'s result, unless `watcher` raises first: then `work` is cancelled, awaited, and the
    watcher's error raised. The watcher is cancelled as soon as `work` ends."""
    try:
        async with asyncio.TaskGroup() as group:
            watching = group.create_task(watcher)
            job = group.create_task(work)
            job.add_done_callback(lambda _: watching.cancel())
    except BaseExceptionGroup as errors:
        found = [e for e in errors.exceptions if isinstance(e, LeaseLost)] or list(errors.exceptions)
        raise found[0] from None
    return job.result()


async def follow(store: Store, owner: str, interval_s: float) -> None:
    """Raise LeaseLost once the output's lease is no longer `owner`'s live lease (for remote workers,
    which write for a run without holding its lease)."""
    cas = ObjectCas(store, LEASE)
    while True:
        data, _ = await asyncio.to_thread(cas.read)
        info = _parse(data)
        if info is None or info.owner != owner or info.expires_at <= time.time():
            raise LeaseLost(
                f"The lease on {store.root_url} is no longer held by the run this worker writes for "
                f"({owner}); the chunk stopped without committing."
            )
        await asyncio.sleep(interval_s)
