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
from rollflow.tasks.storage.store import StorageError, Store

LEASE = "lease.json"
MARGIN_PARTS = 6  # a lease counts as held only while more than ttl / MARGIN_PARTS of it is left
READ_TRIES = 3  # a lease read that fails is tried this often before the error counts
READ_BACKOFF_S = 0.2
T = TypeVar("T")


class LeaseHeld(Exception):
    """Another live run holds the output."""


class LeaseLost(Exception):
    """Our lease was taken over (we were presumed dead); this run must stop writing."""


RUN_RECORD = "run.json"  # the run's identity (the ledger's RUN): an output without it holds no run
GONE_GRACE_S = 1.0  # a second look at an output whose lease object vanished


class OutputGone(StorageError):
    """The output itself disappeared while the run wrote it (its bucket or directory was deleted)."""


def process_space() -> str:
    """Where a pid means one process: this boot of this kernel and this pid namespace.

    Containers or VMs that share a hostname differ here, so a pid of theirs is never looked up here.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


@dataclass
class LeaseInfo:
    owner: str
    host: str
    pid: int
    acquired_at: float
    expires_at: float
    space: str = ""  # process_space() of the owner; "" in leases written before it was recorded

    def owner_alive_here(self) -> bool:
        """False only when the owner is a process of this host, boot and pid namespace that is gone."""
        if self.host != socket.gethostname() or not self.space or self.space != process_space():
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def counted_until(expires_at: float, margin_s: float) -> float:
    """The one lease check's bound: a lease counts as held until `margin_s` (the run's `Lease.margin_s`,
    ttl / MARGIN_PARTS) before it expires, for the run that renews it and for the workers that read it."""
    return expires_at - margin_s


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
        self.space = process_space()
        self.pid = os.getpid()
        self.owner = f"{self.host}:{self.pid}:{secrets.token_hex(4)}"
        self.token: str | None = None
        self.acquired_at = time.time()
        self.lost = False
        self.lost_reason = ""
        self.lost_error: Exception | None = None
        self.margin_s = ttl_s / MARGIN_PARTS
        self.valid_until = counted_until(time.monotonic() + ttl_s, self.margin_s)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollflow-lease")

    def _body(self) -> bytes:
        expires = time.time() + self.ttl_s
        info = LeaseInfo(self.owner, self.host, self.pid, self.acquired_at, expires, self.space)
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
                self.valid_until = counted_until(started + self.ttl_s, self.margin_s)
                return
        data, _ = self.cas.read()
        info = _parse(data)
        raise LeaseHeld(
            self._held_message(info) if info else f"The output {self.store.root_url} is contended."
        )

    def renew(self) -> None:
        """Extend the lease; a write refused because our own earlier write landed (a resent PUT) is ours.

        A lost lease raises LeaseLost; an output that vanished (bucket deleted) raises OutputGone.
        """
        data, token = self.cas.read()
        info = _parse(data)
        if info is not None and info.owner == self.owner:
            if self.cas.write(self._body(), token):
                self.token = self.cas.read()[1]
                return
            data, token = self.cas.read()
            info = _parse(data)
            if info is not None and info.owner == self.owner:
                self.token = token
                return
        if info is None and self._output_going():
            self._lose(
                f"The output {self.store.root_url} disappeared while this run was writing it (its bucket "
                f"or directory was deleted): the chunks it had committed there are gone with it, and "
                f"nothing was published. Recreate the output location and run the same command again to "
                f"collect everything again."
            )
            raise OutputGone(self.lost_reason)
        self._lose(
            f"This run's lease on {self.store.root_url} was taken over by "
            f"{info.owner if info else 'nobody (the lease object was deleted)'}; this run stopped writing "
            f"so that only one run writes the output. Everything it committed is kept."
        )
        raise LeaseLost(self.lost_reason)

    def _output_going(self) -> bool:
        """The lease object is missing: the output is gone, or being deleted (its run.json gone, or gone a
        moment later: a bucket is deleted object by object, and the lease may go before the rest)."""
        for look in range(2):
            if self._output_gone() or not self.store.exists(RUN_RECORD):
                return True
            if look == 0:
                time.sleep(GONE_GRACE_S)
        return False

    def _output_gone(self) -> bool:
        """Whether the output's location holds nothing any more (an S3 bucket gone, a directory removed)."""
        fs = self.store.fs
        fs.invalidate_cache()
        root = self.store.root
        bucket = root.split("/", 1)[0]
        try:
            return not fs.exists(bucket if self.cas.s3 else root) or not fs.find(root, maxdepth=None)
        except FileNotFoundError:
            return True

    def release(self) -> None:
        """Delete the lease only while it is the version this run wrote: never a successor's lease."""
        with contextlib.suppress(Exception):
            data, token = self.cas.read()
            info = _parse(data)
            if info is not None and info.owner == self.owner:
                self.cas.delete(token)
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
                self.valid_until = counted_until(started + self.ttl_s, self.margin_s)
            except (LeaseLost, OutputGone) as exc:
                self.lost_error = exc
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
            raise self.lost_error or LeaseLost(self.lost_reason)

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
            raise self.lost_error or LeaseLost(self.lost_reason)

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
        found = [e for e in errors.exceptions if isinstance(e, LeaseLost | OutputGone)] or list(
            errors.exceptions
        )
        raise found[0] from None
    return job.result()


class OwnerCheck:
    """Whether `owner` surely still holds the output's lease, read from storage, for a process that writes
    for a run without holding its lease (a Dask or Ray worker).

    The one check with the flow's margin: the lease counts only while it has more than `margin_s` left,
    as `Lease.check` counts its own renewal. A read that fails (throttling, a timeout) is retried: while
    the last lease read is still valid by the margin, the run still holds it (a takeover needs expiry).
    """

    def __init__(self, store: Store, owner: str, margin_s: float) -> None:
        self.cas = ObjectCas(store, LEASE)
        self.store, self.owner, self.margin_s = store, owner, margin_s
        self.valid_until = 0.0  # epoch seconds: the last lease read, less the margin

    def judge(self, info: LeaseInfo | None, read_at: float) -> LeaseLost | None:
        """`info` as read at `read_at` (epoch seconds): judged as of then, not as of a later wake-up, since
        the run may have renewed it meanwhile (a busy worker's loop resumes seconds after the read)."""
        until = counted_until(info.expires_at, self.margin_s) if info is not None else 0.0
        if info is None or info.owner != self.owner or until <= read_at:
            return LeaseLost(
                f"The lease on {self.store.root_url} is no longer held by the run this worker writes for "
                f"({self.owner}); the chunk stopped without committing."
            )
        self.valid_until = until
        return None

    def read(self) -> tuple[LeaseInfo | None, float]:
        """The stored lease and when it was read; read errors are retried for READ_TRIES, then raised."""
        for attempt in range(READ_TRIES):
            try:
                return _parse(self.cas.read()[0]), time.time()
            except Exception:
                if attempt == READ_TRIES - 1:
                    raise
                time.sleep(READ_BACKOFF_S * 2**attempt)
        raise AssertionError("unreachable")

    def fence(self) -> None:
        """The ledger's commit fence: raise LeaseLost unless `owner` surely still holds the lease."""
        lost = self.judge(*self.read())
        if lost is not None:
            raise lost

    async def follow(self, interval_s: float) -> None:
        """Raise LeaseLost once the lease is no longer `owner`'s; a read that keeps failing past the last
        good read's validity is an error, one that fails for a while is not."""
        while True:
            try:
                info, read_at = await asyncio.to_thread(self.read)
            except Exception:
                if time.time() >= self.valid_until:
                    raise
            else:
                lost = self.judge(info, read_at)
                if lost is not None:
                    raise lost
            await asyncio.sleep(interval_s)


def owner_fence(store: Store, owner: str, margin_s: float) -> Callable[[], None]:
    """A commit fence for a worker that writes for the run `owner` (see OwnerCheck)."""
    return OwnerCheck(store, owner, margin_s).fence


async def follow(store: Store, owner: str, interval_s: float, margin_s: float) -> None:
    """Raise LeaseLost once the output's lease is no longer `owner`'s live lease (see OwnerCheck)."""
    await OwnerCheck(store, owner, margin_s).follow(interval_s)
