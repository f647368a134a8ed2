"""How worker processes reach the run's share book, through the engine's own primitives.

Dask: the scheduler's metadata store, which every worker and the flow's client already talk to. Ray: the
cluster's key-value store in its GCS, which every Ray process already talks to. Either way the flow
process runs the book (tasks/scaleout/book.py); the engine only carries reports up and the book's answer
down, a few times a second per worker.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from typing import Any

PREFIX = "rollflow-shares"
EXCHANGE_TIMEOUT_S = 2.0  # an exchange with the share book (either side) that takes longer has failed
CLOSE_GRACE_S = 0.5  # between telling the workers the run ended and removing its state from the engine
CLOSED = {"closed": True}  # the book's last answer: the run ended, stop reporting
RAY_NAMESPACE = b"rollflow"


@dataclass
class DaskLink:
    """A worker's link through the scheduler; `bind` in the task's thread, where the worker's client is."""

    key: str
    client: Any = field(default=None, repr=False, compare=False)

    def bind(self) -> DaskLink:
        from distributed import get_client

        return DaskLink(self.key, get_client())

    def exchange(self, worker: str, report: dict[str, Any]) -> dict[str, Any] | None:
        """The book's answer, then this worker's report, unless the run ended (nothing is left behind)."""
        board = self.client.get_metadata([PREFIX, self.key, "board"], None)
        if board is not None and not board.get("closed"):
            self.client.set_metadata([PREFIX, self.key, "reports", worker], report)
        return board

    def __getstate__(self) -> dict[str, Any]:
        return {"key": self.key, "client": None}


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
        """Tell the workers the run ended, then delete the run's key from the scheduler."""
        self.publish(CLOSED)
        time.sleep(CLOSE_GRACE_S)

        def forget(dask_scheduler: Any, key: str = self.key) -> None:  # pickled by value: no rollflow there
            runs = dask_scheduler.task_metadata.get(PREFIX, {})
            runs.pop(key, None)
            if not runs:
                dask_scheduler.task_metadata.pop(PREFIX, None)

        self.client.run_on_scheduler(forget)


def _gcs() -> Any:
    """The Ray cluster's GCS client of this process (a driver or a worker), for its key-value store."""
    from ray.experimental.internal_kv import internal_kv_get_gcs_client

    return internal_kv_get_gcs_client()


def _ray_key(name: str, *parts: str) -> bytes:
    return "/".join((PREFIX, name, *parts)).encode()


@dataclass
class RayLink:
    """A worker's link through the Ray cluster's key-value store (the GCS): no process of its own, so a
    run on Ray starts no actor, whose process would import Ray anew for every run."""

    name: str

    def bind(self) -> RayLink:
        return self

    def exchange(self, worker: str, report: dict[str, Any]) -> dict[str, Any] | None:
        """The book's answer, then this worker's report, unless the run ended (nothing is left behind)."""
        gcs = _gcs()
        raw = gcs.internal_kv_get(_ray_key(self.name, "board"), RAY_NAMESPACE, timeout=EXCHANGE_TIMEOUT_S)
        board = None if raw is None else pickle.loads(raw)
        if board is not None and not board.get("closed"):
            key = _ray_key(self.name, "reports", worker)
            gcs.internal_kv_put(key, pickle.dumps(report), True, RAY_NAMESPACE, timeout=EXCHANGE_TIMEOUT_S)
        return board


@dataclass
class RayChannel:
    """The flow's side on Ray: the run's keys in the GCS key-value store, deleted when the run ends."""

    name: str

    @classmethod
    def start(cls, name: str) -> RayChannel:
        return cls(name)

    def reports(self) -> dict[str, dict[str, Any]]:
        gcs, prefix = _gcs(), _ray_key(self.name, "reports", "")
        keys = gcs.internal_kv_keys(prefix, RAY_NAMESPACE, timeout=EXCHANGE_TIMEOUT_S)
        if not keys:
            return {}
        values = gcs.internal_kv_multi_get(keys, RAY_NAMESPACE, timeout=EXCHANGE_TIMEOUT_S)
        return {key[len(prefix) :].decode(): pickle.loads(raw) for key, raw in values.items()}

    def publish(self, board: dict[str, Any]) -> None:
        key = _ray_key(self.name, "board")
        _gcs().internal_kv_put(key, pickle.dumps(board), True, RAY_NAMESPACE, timeout=EXCHANGE_TIMEOUT_S)

    def close(self) -> None:
        """Tell the workers the run ended, then delete the run's keys."""
        self.publish(CLOSED)
        time.sleep(CLOSE_GRACE_S)
        prefix = _ray_key(self.name, "")
        _gcs().internal_kv_del(prefix, True, RAY_NAMESPACE, timeout=EXCHANGE_TIMEOUT_S)
