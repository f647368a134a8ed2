"""CPU-bound verifiers in a pool of processes: every core verifies, and one bad check costs one rollout.

A check runs in a worker process (verify_worker) under `timeout_s`; past it the worker is killed and
replaced and the rollout fails as `verifier_timeout`; a worker that dies mid-check fails it as
`verifier_crash`. Neither is a reward: the rollout is a failure, retried by the next run. One pool per
process and spec (a Dask or Ray worker process gets its own), shared by every chunk that process runs.

Each process has one dispatcher thread that writes checks and reads replies through non-blocking pipes
in one select() loop, so a check's deadline never waits on a write (a megabyte row queued behind a hung
check) nor a write on a read (a long error text coming back while the next check goes out).
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import logging
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rollflow.settings import redact
from rollflow.tasks.backends.backends import BackendError
from rollflow.tasks.verify.worker import HEADER, READY, frame

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # a worker's import and warm-up (SymPy), never counted against a check
BACKOFF_S = (0.5, 30.0)  # relaunching a process that failed to start: first wait, longest wait
READ_BYTES = 1 << 20


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_processes(node_total: int | None = None, sharers: int = 1) -> int:
    """This process's share of the node's verifier processes. `node_total` (default: the cores, the
    collecting process counted: it keeps one where there are more than two, since it needs about 0.3 ms
    a rollout) is split evenly over the `sharers` worker processes of the node (Dask, Ray)."""
    have = cores()
    total = node_total if node_total is not None else (have if have <= 2 else have - 1)
    return max(1, total // max(1, sharers))


class StartFailed(Exception):
    """A verifier process did not start; the message says why."""


class _Worker:
    """One verifier process and its two non-blocking pipes, with what is still to write and to parse."""

    def __init__(self, spec: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        argv = [sys.executable, "-m", "rollflow.tasks.verify.worker", spec, str(os.getpid())]
        try:
            self.proc = subprocess.Popen(  # its own process group: stopping it stops what its checks started
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, process_group=0
            )
        except OSError as exc:
            raise StartFailed(f"cannot start a process ({type(exc).__name__}: {exc})") from None
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.write_fd, self.read_fd = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self.write_fd, False)
        os.set_blocking(self.read_fd, False)
        self.outgoing = bytearray(frame(sorted(redact.registered())))
        self.incoming = bytearray()
        self.broken = False  # its stdin is closed: it died, what it wrote is still read

    def queue(self, data: bytes) -> None:
        if not self.broken:
            self.outgoing += data

    def step(self, deadline: float | None) -> list[Any]:
        """Write what fits, read what came; the messages complete so far. TimeoutError at `deadline`
        (time.monotonic()), EOFError once the process closed its end and every message was read."""
        messages = self._parse()
        if messages:
            return messages
        writing = [self.write_fd] if self.outgoing and not self.broken else []
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        readable, writable, _ = select.select([self.read_fd], writing, [], wait)
        if writable:
            try:
                sent = os.write(self.write_fd, self.outgoing)
                del self.outgoing[:sent]
            except BlockingIOError:
                pass
            except OSError:
                self.broken, self.outgoing = True, bytearray()
        if readable:
            data = os.read(self.read_fd, READ_BYTES)
            if not data:
                raise EOFError("the process closed its pipe")
            self.incoming += data
            return self._parse()
        if not writable and deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError
        return []

    def _parse(self) -> list[Any]:
        messages, view, at = [], self.incoming, 0
        while len(view) - at >= HEADER.size:
            (size,) = HEADER.unpack_from(view, at)
            if len(view) - at - HEADER.size < size:
                break
            start = at + HEADER.size
            messages.append(pickle.loads(view[start : start + size]))
            at = start + size
        if at:
            del self.incoming[:at]
        return messages

    def start(self, timeout_s: float) -> None:
        """Wait for its READY; StartFailed when it cannot import its verifier or takes too long."""
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                for message in self.step(deadline):
                    if message == READY:
                        return
                    raise StartFailed(f"its process could not load the verifier: {message[1]}")
        except TimeoutError:
            raise StartFailed(
                f"its process was not ready within {timeout_s:g}s (importing the verifier; raise "
                "--verify-start-timeout-s if the import is slow)"
            ) from None
        except EOFError:
            raise StartFailed(f"its process exited while starting (exit {self.proc.wait()})") from None

    def stop(self) -> None:
        """SIGKILL to it and to the processes its checks started, from any thread: its dispatcher then
        reads EOF and retires it."""
        if self.proc.returncode is None:  # not reaped: its pid still names its group
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.proc.kill()

    def kill(self) -> int:
        """Stop it, reap it, close its pipes: only from the thread that drives it."""
        self.stop()
        code = self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()  # type: ignore[union-attr]
        return code


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
    message: bytes  # the framed (row, text), kept to send again to a new process
    future: asyncio.Future[float]
    loop: asyncio.AbstractEventLoop
    meter: VerifyMeter | None
    crashes: int = field(default=0)

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

    Each process's dispatcher keeps `DEPTH` checks in its pipe, so the process never waits for a round
    trip between two checks; a check's timeout runs from when the process begins it. A check whose
    process dies under it is tried once more on a fresh process (the process may have died of another
    cause just as it began), then fails as `verifier_crash`.
    """

    DEPTH = 2
    CRASHES = 2

    def __init__(
        self, spec: str, processes: int, timeout_s: float, start_timeout_s: float = START_TIMEOUT_S
    ) -> None:
        self.spec, self.processes, self.timeout_s = spec, processes, timeout_s
        self.start_timeout_s = start_timeout_s
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._workers: set[_Worker] = set()
        self._ready: set[_Worker] = set()  # started, running checks
        self._told: set[str] = set()
        self._stopping = threading.Event()
        self.closed = False
        self.start_failures = 0  # processes that could not start (their checks fail meanwhile)

    async def check(self, row: dict[str, Any], text: str, meter: VerifyMeter | None = None) -> float:
        loop = asyncio.get_running_loop()
        job = _Job(frame((row, text)), loop.create_future(), loop, meter)
        with self._lock:  # a job queued before close() is settled by it or by a dispatcher
            if self.closed:
                raise BackendError("verifier pool closed (the run is stopping)", kind="verifier_crash")
            self._dispatch()
            self._jobs.put(job)
        return await job.future

    def _dispatch(self) -> None:
        """Start the dispatchers (each launches its process) once; under the lock."""
        if not self._threads:
            for i in range(self.processes):
                thread = threading.Thread(target=self._serve, name=f"rollflow-verify-{i}", daemon=True)
                self._threads.append(thread)
                thread.start()

    async def warm(self) -> float:
        """Start every process and wait until each is ready, one fails to start, or the start timeout
        passes: the seconds it took, so a measurement that follows times checks, not the imports."""
        t0 = time.monotonic()
        with self._lock:
            if self.closed:
                return 0.0
            self._dispatch()
            failed = self.start_failures
        while (
            len(self._ready) < self.processes
            and self.start_failures == failed
            and time.monotonic() - t0 < self.start_timeout_s
        ):
            await asyncio.sleep(0.02)
        return time.monotonic() - t0

    def _spawn(self) -> _Worker:
        """A started worker; StartFailed when it cannot start (or the pool closed meanwhile)."""
        worker = _Worker(self.spec)
        with self._lock:
            if self.closed:
                worker.kill()
                raise StartFailed("the run is stopping")
            self._workers.add(worker)
        try:
            worker.start(self.start_timeout_s)
        except StartFailed:
            self._retire(worker)
            raise
        except Exception as exc:
            self._retire(worker)
            raise StartFailed(f"its process could not be started ({type(exc).__name__}: {exc})") from exc
        with self._lock:
            self._ready.add(worker)
        return worker

    def _retire(self, worker: _Worker) -> int:
        code = worker.kill()
        with self._lock:
            self._workers.discard(worker)
            self._ready.discard(worker)
        return code

    def _serve(self) -> None:
        """One worker process's dispatcher: feed it, read its replies, replace it when it fails."""
        pending: collections.deque[_Job] = collections.deque()
        failures = 0
        while not self.closed:
            try:
                worker = self._spawn()
            except StartFailed as exc:
                if self.closed:
                    break
                self.start_failures += 1
                failures += 1
                self._fail_until(pending, str(exc), min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** (failures - 1)))
                continue
            failures = 0
            try:
                self._drive(worker, pending)
            except Exception as exc:  # a bug here must cost its checks, never the dispatcher
                log.exception("verifier %r: its dispatcher failed", self.spec)
                self._fail_all(pending, f"its dispatcher failed ({type(exc).__name__}: {exc})")
            finally:
                self._retire(worker)
        self._fail_all(pending, "the run is stopping")

    def _fail_until(self, pending: collections.deque[_Job], why: str, backoff_s: float) -> None:
        """Fail the checks held, then wait `backoff_s` before the next launch; while no process of the
        pool runs, checks that come meanwhile fail too (nothing could run them), else they wait for one."""
        if why not in self._told:
            self._told.add(why)
            log.warning("verifier %r: %s; its checks fail until a process starts", self.spec, why)
        self._fail_all(pending, why)
        until = time.monotonic() + backoff_s
        while not self.closed and (left := until - time.monotonic()) > 0:
            if self._ready:
                self._stopping.wait(min(left, 0.1))
                continue
            try:
                job = self._jobs.get(timeout=min(left, 0.1))
            except queue.Empty:
                continue
            if job is None:
                return
            pending.append(job)
            self._fail_all(pending, why)

    def _drive(self, worker: _Worker, pending: collections.deque[_Job]) -> None:
        """Run checks on `worker` until it fails (its checks then stay in `pending`) or the pool closes."""
        for job in pending:  # checks a failed process held, minus the one that failed it
            worker.queue(job.message)
        began = time.monotonic()
        while not self.closed:
            if not pending:
                job = self._jobs.get()
                if job is None:
                    return
                pending.append(job)
                worker.queue(job.message)
                began = time.monotonic()  # the process waited for work: its check begins now
            self._fill(worker, pending)
            try:
                replies = worker.step(began + self.timeout_s)
            except TimeoutError:
                pending.popleft().settle(error=self._timeout_error())
                return
            except EOFError:
                self._crashed(pending, self._retire(worker))
                return
            for status, value, cpu in replies:
                job = pending.popleft()
                now = time.monotonic()
                if job.meter is not None:
                    job.meter.add(cpu, now - began)
                began = now
                if status == "ok":
                    job.settle(value)
                else:
                    error = BackendError(f"verifier failed: {value}", kind="verifier", retryable=False)
                    job.settle(error=error)

    def _fill(self, worker: _Worker, pending: collections.deque[_Job]) -> None:
        """Queue checks until DEPTH are in the pipe; a None (the pool closing) goes back for the loop."""
        while len(pending) < self.DEPTH:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:
                self._jobs.put(None)
                return
            pending.append(job)
            worker.queue(job.message)

    def _crashed(self, pending: collections.deque[_Job], code: int) -> None:
        if not pending:
            return  # it died between checks: nothing was lost
        job = pending[0]
        job.crashes += 1
        if job.crashes >= self.CRASHES:
            pending.popleft().settle(
                error=BackendError(
                    f"verifier {self.spec!r}: its process died on this rollout (exit {code}), "
                    f"{job.crashes} times",
                    kind="verifier_crash",
                )
            )

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

    def close(self) -> None:
        """Stop every worker process; checks still waiting fail (the run is stopping)."""
        with self._lock:
            self.closed = True
            self._stopping.set()
            workers = list(self._workers)
            for _ in self._threads:
                self._jobs.put(None)
        for worker in workers:
            worker.stop()
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.settle(
                    error=BackendError("verifier pool closed (the run is stopping)", kind="verifier_crash")
                )
        with self._lock:  # a None taken above belonged to a dispatcher: it must still wake
            for _ in self._threads:
                self._jobs.put(None)


_pools: dict[tuple[str, int, float, float], VerifyPool] = {}
_pools_lock = threading.Lock()


def shared_pool(
    spec: str, processes: int, timeout_s: float, start_timeout_s: float = START_TIMEOUT_S
) -> VerifyPool:
    """This process's pool for `spec`: chunks (and Dask or Ray tasks) in one process share it."""
    key = (spec, processes, timeout_s, start_timeout_s)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None or pool.closed:
            pool = _pools[key] = VerifyPool(spec, processes, timeout_s, start_timeout_s)
        return pool


def close_pools() -> None:
    """Stop every pool of this process (the end of a run; also at exit)."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.close()


atexit.register(close_pools)
