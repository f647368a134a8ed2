"""The engines chunk tasks run on: Prefect's Dask and Ray task runners, and how each carries the share book.

Dask: an existing scheduler (`--dask-address`), a cluster class that starts its own workers (dask-jobqueue's
SLURMCluster, dask-kubernetes' KubeCluster; `--dask-cluster-class`, scaled by `--dask-adapt-min/max`), or
a local cluster. Ray: a local instance or an existing cluster (`--ray-address`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import os
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from rollflow.flows.engine_addresses import dask_unreachable, ray_address_env, ray_head_unreachable
from rollflow.settings import RunSpec
from rollflow.settings.models import EngineSettings
from rollflow.tasks.collect.runtime import default_chunks_in_flight
from rollflow.tasks.scaleout.channels import DaskChannel, DaskLink, RayChannel, RayLink
from rollflow.tasks.wrappers.worker_chunks import WorkerLost

PRELOAD = "rollflow.tasks.wrappers.preload"
PRELOAD_NANNY = "rollflow.tasks.wrappers.preload_nanny"
LOCAL_WORKERS_START_S = 120.0
RAY_MISSING = (
    "--runner ray needs Ray and prefect-ray, which are not installed: pip install 'rollflow[ray]' "
    "(on the machine that runs the flow and on every Ray node)"
)


class EngineUnavailable(RuntimeError):
    """The engine asked for cannot be used here (not installed, or a cluster class that does not load)."""


@dataclass
class Engine:
    """An entered Prefect task runner (it starts or joins the cluster), the flow's side of the share book
    and the link workers get (both None for an engine opened without a book: chunks that share no limit,
    as reverify's).

    Chunks go to the cluster as plain calls, not Prefect tasks: `submit(fn, name, *args)` runs
    `fn(*args)` on a worker (its task named `name`) and gives the engine's future, `result` waits for it,
    `watch(future, fn)` calls `fn()` (from any thread) once the future has ended, `cancel` cancels
    futures, `slots()` is how many tasks the cluster runs at once now (0 when it does not say).
    """

    runner: Any
    channel: DaskChannel | RayChannel | None
    link: DaskLink | RayLink | None
    submit: Callable[..., Any]
    result: Callable[[Any], Any]
    watch: Callable[[Any, Callable[[], None]], None]
    cancel: Callable[[list[Any]], None]
    slots: Callable[[], int]


def cluster_class(path: str) -> type:
    """`package.module.Class` (or `package.module:Class`) loaded, with an error that says what to fix."""
    module, _, name = path.replace(":", ".").rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise EngineUnavailable(
            f"--dask-cluster-class {path!r} cannot be loaded ({type(exc).__name__}: {exc}); give the "
            "full path of an installed class, e.g. dask_jobqueue.SLURMCluster"
        ) from None


RUNNER_FIELDS = {
    "local": ("collectors",),
    "dask": ("dask_address", "dask_workers", "dask_cluster_class", "dask_cluster_kwargs", "dask_adapt_min",
             "dask_adapt_max"),
    "ray": ("ray_address", "ray_keep_workers_s"),
}  # fmt: skip


def ray_target(spec: EngineSettings) -> str | None:
    """The address a Ray run joins: `--ray-address`, else RAY_ADDRESS (which `ray.init` reads too), else
    None: a local instance of its own."""
    return spec.ray_address or ray_address_env() or None


def keeps_warm_workers(spec: EngineSettings) -> bool:
    """Whether a Ray run keeps its chunk workers: `--ray-keep-workers-s` on a lasting cluster (on a local
    instance, which ends with the run, it keeps nothing)."""
    return bool(spec.ray_keep_workers_s) and ray_target(spec) not in (None, "local")


def engine_fields_set(spec: EngineSettings) -> list[str]:
    """The engine settings (`runner` included) set away from their defaults."""
    return [
        name
        for name in EngineSettings.model_fields
        if getattr(spec, name) != EngineSettings.model_fields[name].get_default(call_default_factory=True)
    ]


def flag(name: str) -> str:
    return name.replace("_", "-")


def engine_notes(spec: EngineSettings) -> list[str]:
    """What a run's engine flags will not do (said before it starts; the run goes on): another runner's
    flags set away from their defaults, and warm Ray workers on a Ray instance that ends with the run."""
    set_here = engine_fields_set(spec)
    notes = [
        f"--{flag(name)} applies to --runner {runner}; --runner {spec.runner} ignores it"
        for runner, names in RUNNER_FIELDS.items()
        if runner != spec.runner
        for name in names
        if name in set_here
    ]
    several = spec.runner == "local" and isinstance(spec.collectors, int) and spec.collectors > 1
    if several and isinstance(spec, RunSpec) and spec.collection.parallelism == "auto":
        notes.append(
            f"--collectors {spec.collectors}: the limit is tuned once and shared by the processes; against "
            "an engine with gauges it does not follow them as one process does (--collectors 1 for that)"
        )
    if spec.runner == "ray" and spec.ray_keep_workers_s and not keeps_warm_workers(spec):
        notes.append(
            "--ray-keep-workers-s keeps nothing on the local Ray instance this run starts and stops; "
            "give --ray-address of a lasting cluster"
        )
    return notes


def engine_problem(spec: EngineSettings) -> str | None:
    """Why `spec`'s runner cannot start here (checked before a run begins), or None."""
    try:
        if spec.runner == "ray":
            if importlib.util.find_spec("prefect_ray") is None:  # found without importing it
                raise EngineUnavailable(RAY_MISSING)
            # A wrong address is said before Ray and Prefect are imported (seconds); `auto` is looked up in
            # Ray's own record, so there Ray is imported first.
            auto = ray_target(spec) == "auto"
            if not auto and (problem := _ray_address_problem(spec)):
                return problem
            ray_runner(spec)
            if auto and (problem := _ray_address_problem(spec)):
                return problem
        elif spec.runner == "dask" and spec.dask_address:  # before the class, as dask_runner reads them
            return dask_unreachable(spec.dask_address)
        elif spec.runner == "dask" and spec.dask_cluster_class:
            cluster_class(spec.dask_cluster_class)
    except EngineUnavailable as exc:
        return str(exc)
    return None


def _ray_address_problem(spec: EngineSettings) -> str | None:
    try:
        return ray_unreachable(spec)
    except ImportError:  # its probes speak gRPC, which comes with Ray's extra: that is what is missing
        raise EngineUnavailable(RAY_MISSING) from None


def ray_unreachable(spec: EngineSettings) -> str | None:
    """Why the Ray cluster a run would join does not answer, or None (a local instance, or it answers)."""
    label = "--ray-address" if spec.ray_address else "RAY_ADDRESS"
    return ray_head_unreachable(ray_target(spec), label=label)


def dask_runner(spec: EngineSettings, chunks: int, threads: int | None = None) -> Any:
    """`threads`: per worker of a local cluster (default: from a run's chunks in flight)."""
    quiet_dask()  # before Dask's distributed loads: it sets its loggers' levels as it imports
    from prefect_dask import DaskTaskRunner

    if spec.dask_address:
        return DaskTaskRunner(address=spec.dask_address)
    if spec.dask_cluster_class:
        adapt = {"minimum": spec.dask_adapt_min, "maximum": spec.dask_adapt_max}
        return DaskTaskRunner(
            cluster_class=cluster_class(spec.dask_cluster_class),
            cluster_kwargs=dict(spec.dask_cluster_kwargs),
            adapt_kwargs={k: v for k, v in adapt.items() if v is not None} or None,
        )
    if threads is None:
        assert isinstance(spec, RunSpec)
        col = spec.collection
        in_flight = col.chunks_in_flight or default_chunks_in_flight(
            col.parallelism if isinstance(col.parallelism, int) else 1, col.chunk_size, col.num_repeats
        )
        threads = max(2, -(-min(in_flight, chunks) // spec.dask_workers))
    workers = {"preload": [PRELOAD], "preload_nanny": [PRELOAD_NANNY]}  # as `dask worker` would be started
    return DaskTaskRunner(
        cluster_kwargs={
            "n_workers": spec.dask_workers,
            "threads_per_worker": threads,
            "processes": True,
            # this machine's own processes: on loopback, and no dashboard open to the network
            "host": "127.0.0.1",
            "dashboard_address": None,
            **workers,
        }
    )


def ray_runner(spec: EngineSettings) -> Any:
    try:
        from prefect_ray import RayTaskRunner
    except ImportError:
        raise EngineUnavailable(RAY_MISSING) from None
    _normalise_ray_env()
    init = {"log_to_driver": False}
    if spec.ray_address == "auto":  # prefect-ray starts a local instance for "auto"; Ray's own joins one
        return RayTaskRunner(address=None, init_kwargs={**init, "address": "auto"})
    return RayTaskRunner(address=spec.ray_address, init_kwargs=init)


def _normalise_ray_env() -> None:
    """`ray.init` reads RAY_ADDRESS as it is (` auto` failed mid-run): it gets it as rollflow's checks read
    it. A blank one is none."""
    if value := ray_address_env():
        os.environ["RAY_ADDRESS"] = value
    else:
        os.environ.pop("RAY_ADDRESS", None)


def quiet_dask() -> None:
    """Dask's INFO logs off in this process only (and only on Dask runs: importing Dask costs about 0.1
    CPU-s): a variable would reach the workers a cluster class starts, and dask-jobqueue waits for a
    worker's INFO line "Registered to:" to know it started."""
    if "DASK_LOGGING__DISTRIBUTED" in os.environ:
        return
    import dask

    dask.config.set({"logging.distributed": "warning"})


@contextlib.contextmanager
def open_engine(
    spec: EngineSettings, key: str, chunks: int, threads: int | None = None, book: bool = True
) -> Iterator[Engine]:
    """The engine for `spec.runner`, entered; its share book channel (unless `book` is False) is closed
    on the way out. `threads`: see dask_runner."""
    if spec.runner == "ray":
        if problem := ray_unreachable(spec):  # a run from a deployment was never checked by the CLI
            raise EngineUnavailable(problem)
        with ray_runner(spec) as runner:
            name = f"rollflow-shares-{key}"
            channel = RayChannel.start(name) if book else None
            try:
                link = RayLink(name) if book else None
                with _ray_calls(spec) as calls:
                    try:
                        yield Engine(runner, channel, link, *calls)
                    finally:  # while the run's own workers live: each reads the end, takes back its report
                        if channel is not None:
                            with contextlib.suppress(Exception):
                                channel.end()
            finally:  # after the run's own workers ended (_ray_calls waits): what is left is deleted
                if channel is not None:
                    with contextlib.suppress(Exception):
                        channel.close()
        return
    if spec.dask_address and (problem := dask_unreachable(spec.dask_address)):  # as Ray's, above
        raise EngineUnavailable(problem)
    with dask_runner(spec, chunks, threads) as runner:
        if not spec.dask_address and not spec.dask_cluster_class:
            # A local cluster's workers all count themselves when sizing their verifier pools: a chunk on
            # the first one up would see itself alone on the node and take every core.
            runner.client.wait_for_workers(spec.dask_workers, timeout=LOCAL_WORKERS_START_S)
        dask_channel = DaskChannel(runner.client, key) if book else None
        try:
            slots = functools.partial(_dask_slots, runner)
            link = DaskLink(key) if book else None
            submit, cancel = _dask_submit(runner), _dask_cancel(runner)
            yield Engine(runner, dask_channel, link, submit, _dask_result, _dask_watch, cancel, slots)
        finally:
            if dask_channel is not None:
                with contextlib.suppress(Exception):
                    dask_channel.close()


def _dask_submit(runner: Any) -> Callable[..., Any]:
    def submit(fn: Callable[..., Any], name: str, *args: Any) -> Any:
        return runner.client.submit(fn, *args, key=f"{name}-{secrets.token_hex(8)}", pure=False)

    return submit


def _dask_result(future: Any) -> Any:
    from distributed import KilledWorker

    try:
        return future.result()
    except KilledWorker as exc:
        raise WorkerLost(f"the chunk's worker process died on each of Dask's attempts ({exc})") from None


def _dask_watch(future: Any, fn: Callable[[], None]) -> None:
    future.add_done_callback(lambda _: fn())


def _dask_cancel(runner: Any) -> Callable[[list[Any]], None]:
    return lambda futures: runner.client.cancel(futures)


def _dask_slots(runner: Any) -> int:
    return sum(runner.client.nthreads().values())


def start_warm_workers(spec: EngineSettings, timeout_s: float) -> tuple[int, int]:
    """`rollflow ray-workers`: the cluster's warm workers started (or found), and how many are up of how
    many there are (one per CPU)."""
    from rollflow.flows.ray_pool import ChunkWorkers

    with ray_runner(spec), ChunkWorkers.opened(spec.ray_keep_workers_s) as pool:
        return pool.wait_started(timeout_s), pool.count


@contextlib.contextmanager
def _ray_calls(spec: EngineSettings) -> Iterator[tuple[Callable[..., Any], ...]]:
    """submit, result, watch, cancel, slots: on chunk workers of the run's own (ending with it), or on warm
    ones kept between runs. Either runs two chunks at a time per worker process: the second takes the
    slots the first one's tail frees (Ray's tasks, one at a time per process, left them idle)."""
    from rollflow.flows.ray_pool import RUN_KEEP_S, ChunkWorkers

    lasting = keeps_warm_workers(spec)
    keep_s = spec.ray_keep_workers_s if lasting else RUN_KEEP_S
    with ChunkWorkers.opened(keep_s, lasting) as pool:
        yield pool.submit, pool.result, pool.watch, pool.cancel, pool.slots
