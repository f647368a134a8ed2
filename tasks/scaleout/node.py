"""How many worker processes of this process's cluster share its node: the verifier pool of each takes
its share of the node's cores (--verify-node-processes), never the whole node."""

from __future__ import annotations

import contextlib
import sys


def node_sharers() -> int:
    """Worker processes of this Dask or Ray cluster on this node (1 outside a worker). It may ask the
    cluster: call it from a thread that runs no event loop."""
    if "distributed" in sys.modules:
        with contextlib.suppress(Exception):
            return _dask_sharers()
    if "ray" in sys.modules:
        with contextlib.suppress(Exception):
            return _ray_sharers()
    return 1


def _dask_sharers() -> int:
    from distributed import Worker

    worker = next(iter(Worker._instances))  # this process's worker, from any of its threads
    host = worker.address.rsplit(":", 1)[0]
    client = worker.client
    try:
        workers = client.scheduler_info(n_workers=-1)["workers"]
    except TypeError:  # versions before the scheduler listed only some workers by default
        workers = client.scheduler_info()["workers"]
    return max(1, sum(1 for address in workers if address.rsplit(":", 1)[0] == host))


def _ray_sharers() -> int:
    """Ray runs one task per CPU of a node (each chunk task asks for one), each in its own process."""
    import ray

    if not ray.is_initialized():
        return 1
    node = ray.get_runtime_context().get_node_id()
    for info in ray.nodes():
        if info.get("NodeID") == node:
            return max(1, int(info.get("Resources", {}).get("CPU", 1)))
    return 1
