"""CPU-bound verifiers in a pool of processes: every core verifies, and one bad check costs one rollout.

A check runs in a worker process (verify_worker) under `timeout_s`; past it the worker is killed and
replaced and the rollout fails as `verifier_timeout`; a worker that dies mid-check fails it as
`verifier_crash`. Neither is a reward: the rollout is a failure, retried by the next run. One pool per
process and spec (a Dask or Ray worker process gets its own), shared by every chunk that process runs.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import queue
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any

from rollflow.settings import redact
from rollflow.tasks.collect.backends import BackendError
from rollflow.tasks.collect.verify_worker import READY, receive, send

START_TIMEOUT_S = 120.0  # a worker's import and warm-up (SymPy), never counted against a check


def default_processes() -> int:
    """The cores this process may use, the collecting process counted: it keeps one where there are
    more than two (it needs about 0.3 ms a rollout, so on smaller machines every core also verifies)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return cores if cores <= 2 else cores - 1


class _Worker:
    """One verifier process and its pipes; `call` sends one check and waits at most `timeout_s`."""

    def __init__(self, spec: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollflow.tasks.collect.verify_worker", spec],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.inbox: IO[bytes] = self.proc.stdin
        self.outbox: IO[bytes] = self.proc.stdout
        send(self.inbox, sorted(redact.registered()))

    def wait_ready(self) -> None:
        if self._wait(START_TIMEOUT_S) != READY:
            raise EOFError("the verifier process did not start")

    def _wait(self, timeout_s: float) -> Any:
        ready, _, _ = select.select([self.outbox], [], [], timeout_s)
        if not ready:
            raise TimeoutError
        return receive(self.outbox)

    def call(self, row: dict[str, Any], text: str, timeout_s: float) -> Any:
        send(self.inbox, (row, text))
        return self._wait(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.inbox, self.outbox):
            with contextlib.suppress(OSError):
                stream.close()


class VerifyPool:
    """`processes` verifier processes behind one async `check`; started on the first check."""

    def __init__(self, spec: str, processes: int, timeout_s: float) -> None:
        self.spec, self.processes, self.timeout_s = spec, processes, timeout_s
        self._idle: queue.Queue[_Worker | None] = queue.Queue()
        self._threads = ThreadPoolExecutor(processes, thread_name_prefix="rollflow-verify")
        self._start_lock = threading.Lock()
        self._started = False
        self._closed = False
        self._workers: set[_Worker] = set()
        self.checks = 0
        self.busy_s = 0.0
        self.timeouts = 0
        self.crashes = 0

    async def check(self, row: dict[str, Any], text: str) -> float:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._threads, self._run, row, text)

    def _start(self) -> None:
        with self._start_lock:
            if self._started:
                return
            workers = [self._spawn_unready() for _ in range(self.processes)]
            for worker in workers:
                self._ready(worker)
            self._started = True

    def _spawn_unready(self) -> _Worker:
        worker = _Worker(self.spec)
        self._workers.add(worker)
        return worker

    def _ready(self, worker: _Worker) -> None:
        try:
            worker.wait_ready()
        except (EOFError, TimeoutError, OSError) as exc:
            worker.kill()
            raise BackendError(
                f"verifier {self.spec!r}: its process did not start ({type(exc).__name__}); see the "
                f"lines it printed above",
                kind="verifier_crash",
            ) from None
        self._idle.put(worker)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.discard(worker)
        if not self._closed:
            self._ready(self._spawn_unready())

    def _run(self, row: dict[str, Any], text: str) -> float:
        if self._closed:
            raise BackendError("verifier pool closed (the run is stopping)", kind="verifier_crash")
        self._start()
        worker = self._idle.get()
        if worker is None:
            raise BackendError("verifier pool closed (the run is stopping)", kind="verifier_crash")
        started = time.perf_counter()
        try:
            reply = worker.call(row, text, self.timeout_s)
        except TimeoutError:
            self.timeouts += 1
            self._replace(worker)
            raise BackendError(
                f"verifier {self.spec!r} took longer than --verify-timeout-s {self.timeout_s:g}s on this "
                f"rollout; its process was stopped",
                kind="verifier_timeout",
            ) from None
        except (EOFError, OSError) as exc:
            self.crashes += 1
            code = worker.proc.poll()
            self._replace(worker)
            raise BackendError(
                f"verifier {self.spec!r}: its process died on this rollout (exit {code}, "
                f"{type(exc).__name__})",
                kind="verifier_crash",
            ) from None
        finally:
            self.busy_s += time.perf_counter() - started
        self.checks += 1
        self._idle.put(worker)
        status, value = reply
        if status != "ok":
            raise BackendError(f"verifier failed: {value}", kind="verifier", retryable=False)
        return float(value)

    def close(self) -> None:
        """Stop every worker process; checks still waiting fail (the run is stopping)."""
        self._closed = True
        for worker in list(self._workers):
            worker.kill()
        for _ in range(self.processes):
            self._idle.put(None)
        self._threads.shutdown(wait=False, cancel_futures=True)


_pools: dict[tuple[str, int, float], VerifyPool] = {}
_pools_lock = threading.Lock()


def shared_pool(spec: str, processes: int, timeout_s: float) -> VerifyPool:
    """This process's pool for `spec`: chunks (and Dask or Ray tasks) in one process share it."""
    key = (spec, processes, timeout_s)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None or pool._closed:
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
