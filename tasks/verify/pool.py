"""CPU-bound verifiers in a pool of processes: every core verifies, and one bad check costs one rollout.

A check runs in a worker process (verify_worker) under `timeout_s`; past it the worker is killed and
replaced and the rollout fails as `verifier_timeout`; a worker that dies mid-check fails it as
`verifier_crash`. Neither is a reward: the rollout is a failure, retried by the next run. One pool per
process and spec (a Dask or Ray worker process gets its own), shared by every chunk that process runs.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import os
import queue
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

from rollflow.settings import redact
from rollflow.tasks.backends.backends import BackendError
from rollflow.tasks.verify.worker import READY, receive, send

START_TIMEOUT_S = 120.0  # a worker's import and warm-up (SymPy), never counted against a check


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_processes() -> int:
    """The cores, the collecting process counted: it keeps one where there are more than two (it needs
    about 0.3 ms a rollout, so on smaller machines every core also verifies)."""
    have = cores()
    return have if have <= 2 else have - 1


class _Worker:
    """One verifier process and its pipes."""

    def __init__(self, spec: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollflow.tasks.verify.worker", spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: a reply read ahead into a buffer would hide from select()
            env=env,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.inbox: IO[bytes] = self.proc.stdin
        self.outbox: IO[bytes] = self.proc.stdout
        send(self.inbox, sorted(redact.registered()))

    def wait(self, timeout_s: float) -> Any:
        """The next message, TimeoutError after `timeout_s`, EOFError if the process died."""
        ready, _, _ = select.select([self.outbox], [], [], max(0.0, timeout_s))
        if not ready:
            raise TimeoutError
        return receive(self.outbox)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.inbox, self.outbox):
            with contextlib.suppress(OSError):
                stream.close()


class VerifyMeter:
    """What checks took, summed over the threads or processes that ran them: CPU seconds, and busy
    seconds (from a process beginning a check to its reply), which stay honest when cores are short."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.busy_s = 0.0
        self.checks = 0
        self._lock = threading.Lock()

    def add(self, cpu_s: float, busy_s: float) -> None:
        with self._lock:
            self.cpu_s += cpu_s
            self.busy_s += busy_s
            self.checks += 1


@dataclass
class _Job:
    row: dict[str, Any]
    text: str
    future: asyncio.Future[float]
    loop: asyncio.AbstractEventLoop
    meter: VerifyMeter | None

    def settle(self, value: float | None = None, error: BaseException | None = None) -> None:
        def apply() -> None:
            if self.future.done():
                return  # the rollout was cancelled (deadline, Ctrl-C) while its check ran
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(value)  # type: ignore[arg-type]

        with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits any more
            self.loop.call_soon_threadsafe(apply)


class VerifyPool:
    """`processes` verifier processes behind one async `check`; started on the first check.

    Each process has a thread that keeps `DEPTH` checks in its pipe, so the process never waits for a
    round trip between two checks; a check's timeout runs from when the process begins it.
    """

    DEPTH = 2

    def __init__(self, spec: str, processes: int, timeout_s: float) -> None:
        self.spec, self.processes, self.timeout_s = spec, processes, timeout_s
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._workers: set[_Worker] = set()
        self.closed = False

    async def check(self, row: dict[str, Any], text: str, meter: VerifyMeter | None = None) -> float:
        loop = asyncio.get_running_loop()
        job = _Job(row, text, loop.create_future(), loop, meter)
        with self._lock:  # a job queued before close() is settled by it or by a dispatcher
            if self.closed:
                raise BackendError("verifier pool closed (the run is stopping)", kind="verifier_crash")
            if not self._threads:
                for i in range(self.processes):
                    thread = threading.Thread(target=self._serve, name=f"rollflow-verify-{i}", daemon=True)
                    self._threads.append(thread)
                    thread.start()
            self._jobs.put(job)
        return await job.future

    def _spawn(self) -> _Worker | None:
        """A started worker, None when the pool closed or the process cannot start (jobs then fail)."""
        worker = _Worker(self.spec)
        with self._lock:
            self._workers.add(worker)
        try:
            if worker.wait(START_TIMEOUT_S) == READY:
                return worker
        except (EOFError, TimeoutError, OSError):
            pass
        self._retire(worker)
        return None

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._workers.discard(worker)

    def _serve(self) -> None:
        """One worker process's dispatcher: feed it, read its replies, replace it when it fails."""
        pending: collections.deque[_Job] = collections.deque()
        while not self.closed:
            worker = self._spawn()
            if worker is None:
                self._fail_all(pending, "its process did not start; see the lines it printed above")
                if self.closed:
                    return
                time.sleep(1.0)
                continue
            try:
                self._drive(worker, pending)
            except Exception as exc:  # a pipe broke mid-send: the process is gone
                self._fail_all(pending, f"its process failed ({type(exc).__name__}: {exc})")
            self._retire(worker)
        self._fail_all(pending, "the run is stopping")

    def _drive(self, worker: _Worker, pending: collections.deque[_Job]) -> None:
        for job in pending:  # checks a failed process held, minus the one that failed it
            send(worker.inbox, (job.row, job.text))
        began = time.monotonic()
        while not self.closed:
            idle = not pending
            if not self._fill(worker, pending, block=idle):
                return
            if idle:  # the process waited for work: its check begins now
                began = time.monotonic()
            try:
                status, value, cpu = worker.wait(began + self.timeout_s - time.monotonic())
            except TimeoutError:
                pending.popleft().settle(error=self._timeout_error())
                return
            except (EOFError, OSError) as exc:
                pending.popleft().settle(error=self._crash_error(worker, exc))
                return
            job = pending.popleft()
            if job.meter is not None:
                job.meter.add(cpu, time.monotonic() - began)
            began = time.monotonic()
            if status == "ok":
                job.settle(float(value))
            else:
                job.settle(error=BackendError(f"verifier failed: {value}", kind="verifier", retryable=False))

    def _fill(self, worker: _Worker, pending: collections.deque[_Job], block: bool) -> bool:
        """Send checks until DEPTH are in the pipe; False when the pool closed."""
        while len(pending) < self.DEPTH:
            try:
                job = self._jobs.get(block=block)
            except queue.Empty:
                return True
            if job is None:
                return False
            pending.append(job)
            send(worker.inbox, (job.row, job.text))
            block = False
        return True

    def _fail_all(self, pending: collections.deque[_Job], why: str) -> None:
        while pending:
            error = BackendError(f"verifier {self.spec!r}: {why}", kind="verifier_crash")
            pending.popleft().settle(error=error)

    def _timeout_error(self) -> BackendError:
        return BackendError(
            f"verifier {self.spec!r} took longer than --verify-timeout-s {self.timeout_s:g}s on this "
            f"rollout; its process was stopped",
            kind="verifier_timeout",
        )

    def _crash_error(self, worker: _Worker, exc: BaseException) -> BackendError:
        code = worker.proc.wait()
        return BackendError(
            f"verifier {self.spec!r}: its process died on this rollout (exit {code}, {type(exc).__name__})",
            kind="verifier_crash",
        )

    def close(self) -> None:
        """Stop every worker process; checks still waiting fail (the run is stopping)."""
        with self._lock:
            self.closed = True
            workers = list(self._workers)
            for _ in self._threads:
                self._jobs.put(None)
        for worker in workers:
            worker.kill()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.settle(
                    error=BackendError("verifier pool closed (the run is stopping)", kind="verifier_crash")
                )


_pools: dict[tuple[str, int, float], VerifyPool] = {}
_pools_lock = threading.Lock()


def shared_pool(spec: str, processes: int, timeout_s: float) -> VerifyPool:
    """This process's pool for `spec`: chunks (and Dask or Ray tasks) in one process share it."""
    key = (spec, processes, timeout_s)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None or pool.closed:
            pool = _pools[key] = VerifyPool(spec, processes, timeout_s)
        return pool


def close_pools() -> None:
    """Stop every pool of this process (the end of a run; also at exit)."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.close()


atexit.register(close_pools)
