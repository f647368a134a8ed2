"""How worker processes reach the run's share book, through the engine's own primitives.

Dask: the scheduler's metadata store, which every worker and the flow's client already talk to. Ray: the
cluster's key-value store in its GCS, which every Ray process already talks to. Either way the flow
process runs the book (tasks/scaleout/book.py); the engine only carries reports up and the book's answer
down, a few times a second per worker.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

log = logging.getLogger(__name__)

PREFIX = "rollflow-shares"
EXCHANGE_TIMEOUT_S = 2.0  # an exchange with the share book (either side) that takes longer has failed
CLOSED = {"closed": True}  # the book's last answer: the run ended, stop reporting
GONE = {"gone": True}  # the run's board was read before and is gone: ended, unless it comes back
RAY_NAMESPACE = b"rollflow"


class LinkState:
    """A worker link's side of the end of a run, the same on every engine.

    A worker writes nothing until it has read a live board of the run (a run that ended first, or whose
    book has not published yet, gets no report). Then it writes its report and reads the board after it:
    a board that is closed or gone means the run's state may already have been removed, so the worker
    deletes the report it just wrote and writes nothing more until it reads a live board again. The flow
    then removes the run's state without waiting for its workers; a worker that dies between its write
    and its read (or whose delete fails) is what can leave a report behind. An exchange without a report
    (nothing new to say) only reads."""

    seen: bool
    worker: str

    def exchange(self, worker: str, report: dict[str, Any] | None) -> dict[str, Any] | None:
        """This worker's report (None: only read) and the book's answer."""
        self.worker = worker
        if not self.seen:
            board = self._read()
            if board is None:
                return None
            if board.get("closed"):
                return CLOSED
            self.seen = True
            if report is None:
                return board
        if report is not None:
            self._write(report)
        board = self._read()
        if board is None or board.get("closed"):
            self.seen = False
            self._forget()
            return GONE if board is None else CLOSED
        return board

    def _read(self) -> dict[str, Any] | None:
        raise NotImplementedError

    def _write(self, report: dict[str, Any]) -> None:
        raise NotImplementedError

    def _forget(self) -> None:
        """Delete the report this worker wrote."""
        raise NotImplementedError


@dataclass
class DaskLink(LinkState):
    """A worker's link through the scheduler; `bind` in the task's thread, where the worker's client is."""

    # Each exchange is a request to the scheduler through the worker's event loop: reading a settled book
    # every POLL_S cost that loop twice the CPU in bench/scale_out.py, and the scheduler ten requests a
    # second per worker. A Dask worker runs several chunks at once, so its share rarely moves mid-run.
    settled_s: ClassVar[float] = 0.5

    key: str
    client: Any = field(default=None, repr=False, compare=False)
    seen: bool = field(default=False, compare=False)  # a live board was read, and no end since (LinkState)
    worker: str = field(default="", compare=False)

    def bind(self) -> DaskLink:
        from distributed import get_client

        return DaskLink(self.key, get_client())

    def _read(self) -> dict[str, Any] | None:
        return self.client.get_metadata([PREFIX, self.key, "board"], None)

    def _write(self, report: dict[str, Any]) -> None:
        self.client.set_metadata([PREFIX, self.key, "reports", self.worker], report)

    def _forget(self) -> None:
        self.client.run_on_scheduler(scheduler_forget(self.key, self.worker))

    def __getstate__(self) -> dict[str, Any]:
        return {"key": self.key, "client": None, "seen": False, "worker": ""}


def scheduler_forget(key: str, worker: str | None = None) -> Callable[[Any], None]:
    """What runs on the scheduler to remove a run's state (or one worker's report of it, leaving a board
    the flow still has to remove). Nested, so it is pickled by value: the scheduler may have no rollflow."""
    prefix = PREFIX

    def forget(dask_scheduler: Any) -> None:
        runs = dask_scheduler.task_metadata.get(prefix, {})
        if worker is None:
            runs.pop(key, None)
        elif key in runs:
            run = runs[key]
            run.get("reports", {}).pop(worker, None)
            if not run.get("reports") and set(run) <= {"reports"}:
                runs.pop(key, None)
        if not runs:
            dask_scheduler.task_metadata.pop(prefix, None)

    return forget


@dataclass
class DaskChannel:
    """The flow's side on Dask: read every worker's report, publish the book's answer."""

    client: Any
    key: str

    def reports(self) -> dict[str, dict[str, Any]]:
        return self.client.get_metadata([PREFIX, self.key, "reports"], {}) or {}

    def publish(self, board: dict[str, Any]) -> None:
        self.client.set_metadata([PREFIX, self.key, "board"], board)

    def close(self) -> None:
        """Tell the workers the run ended, then delete the run's key from the scheduler (even if telling
        them failed); a worker that reports after that deletes its report itself (LinkState)."""
        try:
            self.publish(CLOSED)
        finally:
            self.client.run_on_scheduler(scheduler_forget(self.key))


# A Ray run's end waits at most this long for its workers to take back their reports: they look every
# POLL_S; one that died, or left the run after IDLE_S without a chunk, keeps its report until `close`.
DRAIN_S = 0.5
STALE_S = 600.0  # a run's board unwritten this long was left by a flow that was killed (hosts' clocks)


class RayStore:
    """The cluster's key-value store as this process reaches it: through its GCS client, each call bounded
    by EXCHANGE_TIMEOUT_S, or, on a Ray client driver (`ray://`), which has none, through Ray's client."""

    def __init__(self) -> None:
        from ray.experimental import internal_kv

        self.kv = internal_kv
        self.gcs = internal_kv.internal_kv_get_gcs_client()

    def get(self, key: bytes) -> bytes | None:
        if self.gcs is None:
            return self.kv._internal_kv_get(key, namespace=RAY_NAMESPACE)
        return self.gcs.internal_kv_get(key, RAY_NAMESPACE, timeout=EXCHANGE_TIMEOUT_S)

    def put(self, key: bytes, value: bytes) -> None:
        if self.gcs is None:
            self.kv._internal_kv_put(key, value, True, namespace=RAY_NAMESPACE)
        else:
            self.gcs.internal_kv_put(key, value, True, RAY_NAMESPACE, timeout=EXCHANGE_TIMEOUT_S)

    def under(self, prefix: bytes) -> dict[bytes, bytes]:
        """Every key under `prefix` with its value."""
        if self.gcs is None:
            keys = self.kv._internal_kv_list(prefix, namespace=RAY_NAMESPACE)
            values = {key: self.kv._internal_kv_get(key, namespace=RAY_NAMESPACE) for key in keys}
            return {key: value for key, value in values.items() if value is not None}
        keys = self.gcs.internal_kv_keys(prefix, RAY_NAMESPACE, timeout=EXCHANGE_TIMEOUT_S)
        return self.gcs.internal_kv_multi_get(keys, RAY_NAMESPACE, timeout=EXCHANGE_TIMEOUT_S) if keys else {}

    def delete(self, key: bytes) -> None:
        if self.gcs is None:
            self.kv._internal_kv_del(key, namespace=RAY_NAMESPACE)
        else:
            self.gcs.internal_kv_del(key, False, RAY_NAMESPACE, timeout=EXCHANGE_TIMEOUT_S)

    def delete_under(self, prefix: bytes) -> None:
        if self.gcs is None:
            self.kv._internal_kv_del(prefix, del_by_prefix=True, namespace=RAY_NAMESPACE)
        else:
            self.gcs.internal_kv_del(prefix, True, RAY_NAMESPACE, timeout=EXCHANGE_TIMEOUT_S)


def _ray_key(name: str, *parts: str) -> bytes:
    return "/".join((PREFIX, name, *parts)).encode()


@dataclass
class RayLink(LinkState):
    """A worker's link through the Ray cluster's key-value store (the GCS): no process of its own, so a
    run on Ray starts no actor, whose process would import Ray anew for every run."""

    # A read is a GCS get (about 0.1 ms of the worker's CPU), and a Ray worker process runs one chunk at a
    # time, so shares move at every chunk's end: read at every look (reading a settled book every 0.5 s
    # saved no CPU measurably in bench/scale_out.py).
    settled_s: ClassVar[float] = 0.0

    name: str
    seen: bool = field(default=False, compare=False)  # a live board was read, and no end since (LinkState)
    worker: str = field(default="", compare=False)

    def bind(self) -> RayLink:
        return self

    def _read(self) -> dict[str, Any] | None:
        raw = RayStore().get(_ray_key(self.name, "board"))
        return None if raw is None else pickle.loads(raw)

    def _write(self, report: dict[str, Any]) -> None:
        RayStore().put(_ray_key(self.name, "reports", self.worker), pickle.dumps(report))

    def _forget(self) -> None:
        RayStore().delete(_ray_key(self.name, "reports", self.worker))


@dataclass
class RayChannel:
    """The flow's side on Ray: the run's keys in the cluster's key-value store, deleted when the run ends.

    A flow killed outright leaves its keys (under 1 KB a worker); the next run on the cluster deletes those
    whose board has not been written for STALE_S (a live run's book writes it at least every
    board.REPUBLISH_S). Deleting a live run's keys by mistake (hosts whose clocks differ by most of
    STALE_S) costs it about REPUBLISH_S: workers with chunks running keep their share until the board is
    back; idle ones close their slot and open it again, at share 0, with their next chunk."""

    name: str

    @classmethod
    def start(cls, name: str) -> RayChannel:
        channel = cls(name)
        try:
            channel.sweep()
        except Exception as exc:  # what others left is no reason to fail this run
            log.warning("could not delete share channels left on the Ray cluster: %s", exc)
        return channel

    def sweep(self) -> None:
        """Delete what killed flows left: runs whose board is stale, and reports without a board."""
        store, cut = RayStore(), len(PREFIX) + 1
        runs: dict[str, float] = {}
        for key, raw in store.under(_ray_key("")).items():
            run, _, part = key.decode()[cut:].partition("/")
            written = pickle.loads(raw).get("written_at", 0.0) if part == "board" else 0.0
            runs[run] = max(runs.get(run, 0.0), written)
        for run, written in runs.items():
            if run != self.name and written < time.time() - STALE_S:
                store.delete_under(_ray_key(run, ""))

    def reports(self) -> dict[str, dict[str, Any]]:
        prefix = _ray_key(self.name, "reports", "")
        return {
            key[len(prefix) :].decode(): pickle.loads(raw) for key, raw in RayStore().under(prefix).items()
        }

    def publish(self, board: dict[str, Any]) -> None:
        RayStore().put(_ray_key(self.name, "board"), pickle.dumps({**board, "written_at": time.time()}))

    def end(self) -> None:
        """Tell the workers the run ended, and wait (DRAIN_S at most) while they take back their reports,
        as each does at its next look at the board (every POLL_S). Called while the run's own workers
        live: Ray ends them next, and one ended between writing a report and reading the board could have
        its report land after `close` deleted the run's keys; a worker that has read the end writes none."""
        self.publish(CLOSED)
        until = time.monotonic() + DRAIN_S
        while self.reports() and time.monotonic() < until:
            time.sleep(0.02)

    def close(self) -> None:
        """Tell the workers the run ended (again, if `end` did), then delete the run's keys (even if
        telling them failed); a worker that reports after that deletes its report itself (LinkState)."""
        try:
            self.publish(CLOSED)
        finally:
            RayStore().delete_under(_ray_key(self.name, ""))
