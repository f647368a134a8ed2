"""How worker processes reach the run's share book, through the engine's own primitives.

Dask: the scheduler's metadata store, which every worker and the flow's client already talk to. Ray: a
small named actor the flow starts. Either way the flow process runs the book (tasks/scaleout/book.py);
the engine only carries reports up and the book's answer down, a few times a second per worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

PREFIX = "rollflow-shares"
EXCHANGE_TIMEOUT_S = 2.0  # an exchange with the share book (either side) that takes longer has failed
CLOSE_GRACE_S = 0.5  # between telling the workers the run ended and removing its state from the engine
CLOSED = {"closed": True}  # the book's last answer: the run ended, stop reporting
RAY_NAMESPACE = "rollflow"


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


class ShareBoard:
    """The Ray actor's body: the newest report of each worker and the book's newest answer."""

    def __init__(self) -> None:
        self._reports: dict[str, dict[str, Any]] = {}
        self._board: dict[str, Any] | None = None

    def exchange(self, worker: str, report: dict[str, Any]) -> dict[str, Any] | None:
        self._reports[worker] = report
        return self._board

    def reports(self) -> dict[str, dict[str, Any]]:
        return dict(self._reports)

    def publish(self, board: dict[str, Any]) -> None:
        self._board = board


@dataclass
class RayLink:
    """A worker's link to the run's named ShareBoard actor."""

    name: str
    actor: Any = field(default=None, repr=False, compare=False)

    def bind(self) -> RayLink:
        return self

    def exchange(self, worker: str, report: dict[str, Any]) -> dict[str, Any] | None:
        import ray

        if self.actor is None:
            self.actor = ray.get_actor(self.name, namespace=RAY_NAMESPACE)
        return ray.get(self.actor.exchange.remote(worker, report), timeout=EXCHANGE_TIMEOUT_S)

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "actor": None}


@dataclass
class RayChannel:
    """The flow's side on Ray: the run's ShareBoard actor, started on the flow's node and ended with it."""

    actor: Any

    @classmethod
    def start(cls, name: str) -> RayChannel:
        import ray

        board = ray.remote(num_cpus=0)(ShareBoard)
        return cls(board.options(name=name, namespace=RAY_NAMESPACE, max_concurrency=1).remote())

    def reports(self) -> dict[str, dict[str, Any]]:
        import ray

        return ray.get(self.actor.reports.remote(), timeout=EXCHANGE_TIMEOUT_S)

    def publish(self, board: dict[str, Any]) -> None:
        """Not waited for: an actor runs one caller's calls in order, so the next round's `reports` comes
        after it, and waiting would block the round on a second round trip."""
        self.actor.publish.remote(board)

    def close(self) -> None:
        import ray

        ray.get(self.actor.publish.remote(CLOSED), timeout=EXCHANGE_TIMEOUT_S)
        time.sleep(CLOSE_GRACE_S)
        ray.kill(self.actor)
