"""Chunk calls on Ray's chunk workers (tasks/wrappers/ray_actor.py): one worker per CPU of the cluster,
each given SEATS calls at a time once it answered; calls wait here, in submission order, for a free seat,
as Ray's own queue keeps tasks. Warm workers (`--ray-keep-workers-s`) are found by name (started by an
earlier run or `rollflow ray-workers`) or started, and kept; a run without them starts workers of its own,
which end with it. Every COUNT_S while calls wait, the cluster's CPUs are counted again.

Workers are named by a fingerprint of this rollflow's code: a run never sends chunks to a worker that
imported other code. While a run goes on Ray (warm or not), IdleSweep ends the warm workers it cannot use
once they are idle, which would hold their CPUs until their keep time ran out. A call whose worker died
(killed, its node lost, or ended idle as the call was on its way) goes to a new worker, RESENDS times at
most, as Ray retries a task whose process died.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from rollflow.tasks.wrappers.ray_actor import NAME_PREFIX, NAMESPACE, SEATS, ChunkWorker
from rollflow.tasks.wrappers.worker_chunks import WorkerLost

log = logging.getLogger(__name__)
RESENDS = 3
STALE_ASK_S = 5.0  # how long the idle checks of workers a run ends may take
IDLE_END_S = 2.0  # idle this long, a worker serves no run now (a run sends a freed worker its next call)
TICK_S = 5.0  # how often idle warm workers are looked for
# While calls wait, how often the cluster's CPUs are counted and dead workers started again: a node that
# joins gets its worker within about a second (Ray's tasks went there as it joined). One GCS call.
COUNT_S = 1.0
RUN_KEEP_S = 3600.0  # a run's own workers end with it; this only bounds one a lost flow would leave
END_WAIT_S = 5.0  # how long a run waits for its own workers to be gone
NO_WORKER_NOTE_S = 20.0  # calls waiting this long with no worker up: say why, once


@functools.cache
def code_fingerprint() -> str:
    """A digest of the rollflow modules a worker runs (tasks/, settings/): a worker started by other code
    is never reused."""
    import rollflow.settings
    import rollflow.tasks

    digest = hashlib.blake2b(digest_size=6)
    for package in (rollflow.tasks, rollflow.settings):
        for folder in package.__path__:
            root = Path(folder)
            for path in sorted(root.rglob("*.py")):
                digest.update(str(path.relative_to(root)).encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def chunk_error(exc: RayTaskError) -> BaseException:
    """The chunk's own error, not Ray's wrapper of it (whose text carries the worker's whole traceback)."""
    return exc.cause if isinstance(exc.cause, Exception) else exc


class Call(Future[Any]):
    """A chunk call: waiting here, then on a worker (`ref`), then ended with the call's value or error."""

    def __init__(self, fn: Callable[..., Any], name: str, args: tuple[Any, ...]) -> None:
        super().__init__()
        self.fn, self.name, self.args = fn, name, args
        self.sends = 0
        self.ref: Any = None
        self.dropped = False  # cancelled by the flow: never sent again


def end_idle_workers(spare: str | None = None) -> None:
    """Ends the warm workers idle for IDLE_END_S, but those whose names start with `spare` (a run's own): a
    run on Ray's tasks, or on workers of other code, would wait for the CPUs they hold until their keep
    time ran out. A busy one is left to end its chunk, then itself."""
    asked = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry.get("name", "")
        if entry.get("namespace") != NAMESPACE or not name.startswith(NAME_PREFIX):
            continue
        if spare is None or not name.startswith(spare):
            with contextlib.suppress(ValueError, RayActorError):
                handle = ray.get_actor(name, namespace=NAMESPACE)
                asked.append((name, handle, handle.idle_s.remote()))
    deadline = time.monotonic() + STALE_ASK_S
    for name, handle, idle in asked:
        with contextlib.suppress(RayActorError, GetTimeoutError):
            if ray.get(idle, timeout=max(0.0, deadline - time.monotonic())) >= IDLE_END_S:
                ray.kill(handle, no_restart=True)
                log.info("ended the idle Ray chunk worker %s", name)


class IdleSweep:
    """`end_idle_workers(spare)` now and every TICK_S on a thread of its own, until the run ends: workers
    that go idle mid-run (another code's, a finished run's) give their CPUs to this run then."""

    def __init__(self, spare: str | None = None) -> None:
        self.spare = spare
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rollflow-ray-sweep", daemon=True)

    def __enter__(self) -> IdleSweep:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()

    def _run(self) -> None:
        while True:
            try:
                end_idle_workers(self.spare)
            except Exception as exc:  # the cluster unreachable for now: the next sweep tries again
                log.debug("sweeping idle Ray chunk workers failed: %s: %s", type(exc).__name__, exc)
            if self.stop.wait(TICK_S):
                return


class ChunkWorkers:
    """The engine's calls (submit, result, watch, cancel, slots) on chunk workers: the cluster's warm ones
    (`lasting`: detached, named, kept between runs) or the run's own, which end with it. Every Ray call is
    made on one thread of the pool's own; Ray's done callbacks only queue an event for it."""

    def __init__(self, keep_s: float, count: int, lasting: bool = True) -> None:
        self.keep_s, self.count, self.lasting = keep_s, count, lasting
        self.generation = code_fingerprint()
        self.handles: list[Any] = [None] * count
        self.seats: dict[int, int] = {}  # started workers: calls running on each
        self.starting: set[int] = set()
        self.waiting: deque[Call] = deque()
        self.events: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.lock = threading.Lock()  # `waiting`, between submit/cancel and the pool's thread
        self.opened_at, self.said_no_worker = time.monotonic(), False
        self.thread = threading.Thread(target=self._serve, name="rollflow-ray-workers", daemon=True)

    @classmethod
    @contextlib.contextmanager
    def opened(cls, keep_s: float, lasting: bool = True) -> Iterator[ChunkWorkers]:
        """A run's own workers (not `lasting`) spare no warm worker: idle ones hold the CPUs they need."""
        pool = cls(keep_s, max(1, int(ray.cluster_resources().get("CPU", 0))), lasting)
        with IdleSweep(spare=f"{NAME_PREFIX}-{pool.generation}-" if lasting else None):
            pool.thread.start()
            pool.events.put(pool._start_missing)
            try:
                yield pool
            finally:
                pool.close()

    def submit(self, fn: Callable[..., Any], name: str, *args: Any) -> Call:
        call = Call(fn=fn, name=name, args=args)
        with self.lock:
            self.waiting.append(call)
        self.events.put(self._dispatch)
        return call

    def result(self, call: Call) -> Any:
        return call.result()

    def watch(self, call: Call, fn: Callable[[], None]) -> None:
        call.add_done_callback(lambda _: fn())

    def cancel(self, calls: list[Call]) -> None:
        """Waiting calls end cancelled; running ones are asked to stop (a chunk stops itself at its run's
        deadline or when its run's lease is gone, whichever Ray does with the request)."""
        with self.lock:
            for call in calls:
                call.dropped = True
                if call in self.waiting:
                    self.waiting.remove(call)
                    call.cancel()
        for call in calls:
            if call.ref is not None:
                with contextlib.suppress(Exception):
                    ray.cancel(call.ref)

    def slots(self) -> int:
        return self.count * SEATS

    def close(self) -> None:
        """Waiting calls end cancelled. Warm workers still starting are kept, as started ones are: the next
        run finds them (one waiting for a CPU or a node starts once it comes, and ends after its keep
        time). A run's own workers are ended, as Ray ends a job's task workers with it."""
        with self.lock:
            left, self.waiting = list(self.waiting), deque()
        for call in left:
            call.cancel()
        self.events.put(None)
        self.thread.join(timeout=30)
        if not self.lasting:
            self._end_own()

    def _end_own(self) -> None:
        """Ends the run's own workers and waits (END_WAIT_S at most) until each is gone: `ray.kill` only
        asks, and a worker still alive could write its share report after the flow deleted the run's."""
        handles = [handle for handle in self.handles if handle is not None]
        for handle in handles:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        deadline = time.monotonic() + END_WAIT_S
        for handle in handles:
            while time.monotonic() < deadline:
                try:
                    ray.get(handle.idle_s.remote(), timeout=max(0.01, deadline - time.monotonic()))
                except (RayActorError, GetTimeoutError):
                    break
                except Exception:  # the cluster unreachable: nothing more to wait for
                    return
                time.sleep(0.02)

    def wait_started(self, timeout_s: float) -> int:
        """Every worker started, or `timeout_s` passed: how many are up."""
        deadline = time.monotonic() + timeout_s
        while (self.starting or None in self.handles) and time.monotonic() < deadline:
            time.sleep(0.1)
        return sum(
            1 for slot, handle in enumerate(self.handles) if handle is not None and slot not in self.starting
        )

    def _serve(self) -> None:
        """Events as they come, and `_tick` every COUNT_S whether or not they come."""
        next_tick = time.monotonic() + COUNT_S
        while True:
            try:
                event = self.events.get(timeout=max(0.0, next_tick - time.monotonic()))
            except queue.Empty:
                pass
            else:
                if event is None:
                    return
                self._handle(event)
            if time.monotonic() >= next_tick:
                next_tick = time.monotonic() + COUNT_S
                self._handle(self._tick)

    def _handle(self, event: Callable[[], None]) -> None:
        try:
            event()
        except Exception:  # the pool's thread must outlive a failed Ray call, or every chunk would hang
            log.exception("the Ray chunk workers' pool could not handle an event; it goes on")

    def _tick(self) -> None:
        """While calls wait: a worker for each CPU that joined the cluster (a node started, an autoscaler's),
        and again for each slot whose worker died or could not start."""
        if not self.waiting:
            return
        cpus = int(ray.cluster_resources().get("CPU", 0))
        if cpus > self.count:
            self.handles += [None] * (cpus - self.count)
            self.count = cpus
        self._start_missing()
        waited_s = time.monotonic() - self.opened_at
        if not self.seats and not self.said_no_worker and waited_s > NO_WORKER_NOTE_S:
            self._say_no_worker(cpus)

    def _say_no_worker(self, cpus: int) -> None:
        """Once: why a run whose calls wait has no worker (it would wait without a word otherwise)."""
        self.said_no_worker = True
        free = ray.available_resources().get("CPU", 0)
        log.warning(
            "no Ray chunk worker has started in %.0f s: the cluster has %d CPUs, %g of them free; "
            "chunks wait until a CPU is free (another run's workers or other Ray work hold them) "
            "or a node joins",
            NO_WORKER_NOTE_S, cpus, free,
        )  # fmt: skip

    def _start_missing(self) -> None:
        for slot, handle in enumerate(self.handles):
            if handle is None and slot not in self.starting:
                self._start(slot)

    def _start(self, slot: int) -> None:
        """Found by name, or started; given calls only once it answers: one waiting for a CPU (held by other
        work) or for a node (an autoscaler's) would hold them while started workers had none."""
        options: dict[str, Any] = {"scheduling_strategy": "SPREAD"}
        if self.lasting:
            name = f"{NAME_PREFIX}-{self.generation}-{slot}"
            options |= {"name": name, "namespace": NAMESPACE, "lifetime": "detached", "get_if_exists": True}
        try:
            handle = ChunkWorker.options(**options).remote(self.keep_s)
            ref = handle.keep.remote(self.keep_s)  # a worker found by name takes this run's keep time
        except Exception as exc:  # e.g. the name's worker died as it was looked up: a later tick tries again
            log.warning("a Ray chunk worker could not be started (%s: %s)", type(exc).__name__, exc)
            self.handles[slot] = None
            return
        self.handles[slot] = handle
        self.starting.add(slot)
        self._on_end(ref, functools.partial(self._started, slot, ref))

    def _started(self, slot: int, ref: Any) -> None:
        self.starting.discard(slot)
        try:
            ray.get(ref)
        except Exception as exc:
            log.warning("a Ray chunk worker did not start (%s: %s); tried again", type(exc).__name__, exc)
            self.handles[slot] = None  # started again at a later tick
            return
        self.seats[slot] = 0
        self._dispatch()

    def _on_end(self, ref: Any, event: Callable[[], None]) -> None:
        ref.future().add_done_callback(lambda _: self.events.put(event))

    def _dispatch(self) -> None:
        """On the pool's thread: the least busy started worker with a free seat takes the oldest waiting
        call, until no call waits or no seat is free."""
        while self.seats:
            busy, slot = min((busy, slot) for slot, busy in self.seats.items())
            if busy >= SEATS:
                return
            handle = self.handles[slot]
            with self.lock:  # sent under it: `cancel` sees a call either waiting or with its `ref`
                if not self.waiting:
                    return
                call = self.waiting.popleft()
                call.sends += 1
                try:
                    call.ref = handle.call.options(name=call.name).remote(call.fn, *call.args)
                except Exception as exc:  # not sent (the cluster unreachable, arguments that do not pickle)
                    call.set_exception(exc)
                    continue
            self.seats[slot] += 1
            self._on_end(call.ref, functools.partial(self._ended, slot, handle, call))

    def _ended(self, slot: int, handle: Any, call: Call) -> None:
        """A call's end; its worker's seat is free again, unless the worker died: the first of its calls
        to see that starts a new worker under its name, and each call goes to a new worker."""
        live = self.handles[slot] is handle and slot in self.seats
        if live:
            self.seats[slot] -= 1
        try:
            call.set_result(ray.get(call.ref))
        except RayActorError as exc:
            self._resend(call, exc)
            if live:
                del self.seats[slot]
                self._start(slot)
        except RayTaskError as exc:
            call.set_exception(chunk_error(exc))
        except Exception as exc:
            call.set_exception(exc)
        self._dispatch()

    def _resend(self, call: Call, exc: Exception) -> None:
        if call.dropped:
            call.set_exception(exc)
            return
        if call.sends > RESENDS:
            lost = WorkerLost(f"the chunk's Ray worker died on each of its {call.sends} sends ({exc})")
            call.set_exception(lost)
            return
        log.warning("the Ray chunk worker running %s died; the call goes to a new worker", call.name)
        call.ref = None
        with self.lock:
            self.waiting.appendleft(call)
