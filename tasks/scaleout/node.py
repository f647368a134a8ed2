"""How many worker processes of this process's cluster share its node: the verifier pool of each takes
its share of the node's cores (--verify-node-processes), never the whole node."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIES = 3  # a failed count is asked again: counted 1, this process's verifier pool would take every core


def node_sharers() -> int:
    """Worker processes of this Dask or Ray cluster on this node (1 outside a worker). It may ask the
    cluster: call it from a thread that runs no event loop."""
    for engine, count in (("distributed", _dask_sharers), ("ray", _ray_sharers)):
        if engine in sys.modules:
            found = _asked(count)
            if found is not None:
                return found
    return 1


def _asked(count: Callable[[], int | None]) -> int | None:
    """`count()` (None: not that engine's worker process), asked up to TRIES times; 1 (with a warning) if
    every try failed."""
    error: Exception | None = None
    for attempt in range(TRIES):
        if attempt:
            time.sleep(0.2 * attempt)
        try:
            return count()
        except Exception as exc:
            error = exc
    log.warning(
        "could not count this node's worker processes (%s: %s): this process sizes its verifier pool as if "
        "it were alone on the node; --verify-processes sets each worker process's pool instead",
        type(error).__name__,
        error,
    )
    return 1


def _dask_sharers() -> int | None:
    from distributed import Worker

    worker = next(iter(Worker._instances), None)  # this process's worker, from any of its threads
    if worker is None:
        return None  # not a Dask worker process
    from distributed.utils import sync

    host = worker.address.rsplit(":", 1)[0]
    # Asked through the worker's own connection to the scheduler: no client to make first (a step that can
    # time out on a loaded node), and none whose `scheduler_info` answers from a cache listing no worker
    # (an asynchronous client's, when called on its loop).
    workers = sync(worker.loop, worker.scheduler.identity, n_workers=-1)["workers"]
    found = sum(1 for address in workers if address.rsplit(":", 1)[0] == host)
    if not found:
        raise LookupError(f"the scheduler lists no worker on {host}")
    return found


def _ray_sharers() -> int | None:
    """Ray runs one task per CPU of a node (each chunk task asks for one), each in its own process."""
    import ray

    if not ray.is_initialized():
        return None
    node = ray.get_runtime_context().get_node_id()
    for info in ray.nodes():
        if info.get("NodeID") == node:
            return max(1, int(info.get("Resources", {}).get("CPU", 1)))
    return 1
