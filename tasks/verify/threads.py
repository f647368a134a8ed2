"""Synchronous checks on threads of the collecting process (`--verify-processes 0`, and the cheap
built-ins), under the same timeout as the pool.

The threads are this module's own daemon threads, never the event loop's default executor (which also
commits, flushes and writes parts): a hung check pins one of them, not the run, and never keeps the
process from exiting. A thread cannot be stopped, so a check past its timeout fails its rollout as
`verifier_timeout`, its thread is left to finish and a new one takes its place, up to MAX_HELD held
threads; past that, checks wait for a thread to free and time out as verifier_timeout if none does.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollflow.tasks.backends.backends import BackendError
from rollflow.tasks.verify.pool import VerifyMeter

THREADS = 8
# Threads held by checks past their timeout, at most: past it no replacement starts, so new checks wait for
# a thread that frees (failing as verifier_timeout if none does within their timeout). 500 hung checks
# left 501 threads before.
MAX_HELD = 64


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    meter: VerifyMeter | None
    began: float | None = None
    finished: bool = False
    abandoned: bool = False
    queued: float = 0.0
    dropped: bool = False  # timed out in the queue (every thread held): no thread runs it

    def settle(self, value: Any = None, error: BaseException | None = None) -> None:
        def apply() -> None:
            if not self.future.done():
                if error is not None:
                    self.future.set_exception(error)
                else:
                    self.future.set_result(value)

        with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits any more
            self.loop.call_soon_threadsafe(apply)


class CheckThreads:
    """`threads` daemon threads running synchronous checks; `run` waits at most `timeout_s` from when
    a thread begins the check, then raises TimeoutError."""

    def __init__(self, threads: int = THREADS, max_held: int = MAX_HELD) -> None:
        self.threads, self.max_held = threads, max_held
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._running = 0  # threads alive
        self._held = 0  # threads running a check past its timeout

    async def run(self, fn: Callable[[], Any], timeout_s: float, meter: VerifyMeter | None = None) -> Any:
        loop = asyncio.get_running_loop()
        call = _Call(fn, loop.create_future(), loop, meter, queued=time.monotonic())
        self._calls.put(call)
        self._ensure()
        try:
            while True:
                if call.began is None and self._dropped(call, timeout_s):
                    raise TimeoutError
                left = timeout_s if call.began is None else call.began + timeout_s - time.monotonic()
                if call.began is None and self._held >= self.max_held:
                    left = max(0.01, call.queued + timeout_s - time.monotonic())
                if left <= 0:
                    raise TimeoutError
                done, _ = await asyncio.wait({call.future}, timeout=left)
                if done:
                    return call.future.result()
        except BaseException:
            with self._lock:
                if call.began is not None and not call.finished:
                    call.abandoned = True  # its thread is held by a check nobody waits for
                    self._held += 1
            self._ensure()
            raise

    def _dropped(self, call: _Call, timeout_s: float) -> bool:
        """At the cap, a check that waited its whole timeout for a thread is dropped from the queue."""
        with self._lock:
            full = self._held >= self.max_held
            if call.began is None and full and time.monotonic() - call.queued >= timeout_s:
                call.dropped = True
            return call.dropped

    def _ensure(self) -> None:
        """`threads` threads free of abandoned checks, while fewer than `max_held` are held by them."""
        with self._lock:
            while self._running - self._held < self.threads and self._running < self.threads + self.max_held:
                self._running += 1
                threading.Thread(target=self._serve, name="rollflow-verify-thread", daemon=True).start()

    def _serve(self) -> None:
        while True:
            call = self._calls.get()
            with self._lock:
                if call.dropped:
                    continue
                call.began = time.monotonic()
            cpu = time.thread_time()
            try:
                value, error = call.fn(), None
            except (
                BaseException
            ) as exc:  # a check's sys.exit() or KeyboardInterrupt ends its check, not the thread
                value, error = None, exc if isinstance(exc, Exception) else _raised(exc)
            if call.meter is not None:
                call.meter.add(time.thread_time() - cpu, time.monotonic() - call.began)
            with self._lock:
                call.finished = True
                if call.abandoned:
                    self._held -= 1
                    if self._running - self._held > self.threads:  # a replacement took its place
                        self._running -= 1
                        return
            call.settle(value, error)


def _raised(exc: BaseException) -> BackendError:
    """A check's SystemExit or KeyboardInterrupt, worded as a verifier process words it."""
    return BackendError(f"verifier failed: {type(exc).__name__}: {exc}", kind="verifier", retryable=False)


_threads = CheckThreads()


def check_threads() -> CheckThreads:
    """This process's check threads, shared by every verifier and event loop in it."""
    return _threads
