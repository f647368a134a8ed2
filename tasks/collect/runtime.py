"""The per-process objects of one run, built from its spec and the environment's secrets."""

from __future__ import annotations

import contextlib
import resource
from dataclasses import dataclass, field
from typing import Any

from rollflow.settings import RollflowSettings, RunSpec, redact
from rollflow.tasks.backends.endpoints import EndpointPool, split_limit
from rollflow.tasks.backends.limiter import ConcurrencyLimit
from rollflow.tasks.collect.clock import StageClock
from rollflow.tasks.collect.rollouts import CollectContext
from rollflow.tasks.collect.rows import InputError
from rollflow.tasks.storage.ledger import Ledger
from rollflow.tasks.storage.store import Store
from rollflow.tasks.verify.verifiers import make_verifier


@dataclass
class RunHandles:
    spec: RunSpec
    store: Store
    ledger: Ledger
    input_options: dict[str, Any]
    output_options: dict[str, Any]
    dataset_options: dict[str, Any]
    lease_owner: str | None = None  # set while the run holds the output's lease; remote workers check it
    lease_margin_s: float = 0.0  # how much of the lease must be left for a worker to count it as held
    clock: StageClock = field(default_factory=StageClock)


FILES_PER_RUN = 256  # the run's own files beside its connections: parts, commits, the lease, its logs


def raise_open_files(parallelism: int) -> int:
    """The process's soft open-files limit raised as far as `parallelism` connections need (never above
    the hard limit); the limit now. At 1,000-4,000 in flight the usual soft limit (1024) failed the run's
    own files with EMFILE, and every attempt re-sent its requests and lost their replies."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = parallelism + FILES_PER_RUN
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
    return soft


def check_open_files(spec: RunSpec) -> None:
    """Before any request: the most the run may hold in flight fits the open-files limit, raised if need be;
    a fixed parallelism that cannot fit is refused, naming the limit."""
    parallelism = spec.collection.parallelism
    most = parallelism if isinstance(parallelism, int) else spec.tuning.max_parallelism
    limit = raise_open_files(most)
    if limit != resource.RLIM_INFINITY and isinstance(parallelism, int) and limit < most + FILES_PER_RUN:
        raise InputError(
            f"--parallelism {most} needs about {most + FILES_PER_RUN} open files, and this process may open "
            f"{limit} (its hard limit, `ulimit -Hn`). Raise it (`ulimit -n {most + FILES_PER_RUN}`, or "
            f"LimitNOFILE= for a service), or run with --parallelism {max(1, limit - FILES_PER_RUN)} or "
            f"less. No request was sent."
        )


def open_run(spec: RunSpec, settings: RollflowSettings) -> RunHandles:
    redact.register(settings)
    check_open_files(spec)
    storage = settings.storage
    output_options = storage.storage_options(spec.output)
    store = Store(spec.output, output_options)
    return RunHandles(
        spec=spec,
        store=store,
        ledger=Ledger(store),
        input_options=storage.storage_options(spec.input),
        output_options=output_options,
        dataset_options=storage.storage_options(spec.dataset_url()),
    )


def collect_context(
    handles: RunHandles,
    settings: RollflowSettings,
    parallelism: int | dict[str, int],
    shared: bool = False,
    sharers: int = 1,
) -> CollectContext:
    """`parallelism` is the total (split evenly over the endpoints) or each endpoint's limit by URL.

    `shared`: this process is one of several workers of the run; it starts with no share of the limit
    and sends nothing until the run's share book gives it one. `sharers`: the worker processes of this
    node, which split its verifier processes.
    """
    spec = handles.spec
    verify = spec.verify.model_copy(update={"verifier": spec.verify.verifier_for(spec.backend.kind.value)})
    verifier = make_verifier(verify, sharers=sharers)
    urls = spec.backend.urls
    limits = split_limit(parallelism, urls) if isinstance(parallelism, int) else parallelism
    limits = {url: limits[url] for url in urls}
    limit = ConcurrencyLimit(0, minimum=0) if shared else ConcurrencyLimit(sum(limits.values()))
    pool = EndpointPool(urls, limits, limit, spec.backend.groups())
    if shared:
        pool.set_share(0, limits)
    return CollectContext(
        ledger=handles.ledger,
        input_url=spec.input,
        input_options=handles.input_options,
        backend=spec.backend_settings(settings.backend.api_key),
        collection=spec.collection,
        verifier=verifier,
        limit=limit,
        pool=pool,
        correct_threshold=spec.verify.correct_threshold,
    )


def default_chunks_in_flight(parallelism: int, chunk_size: int, num_repeats: int) -> int:
    """Enough chunks at once that a chunk's tail never leaves the limit idle, and never fewer than 2."""
    per_chunk = max(1, chunk_size * num_repeats)
    return max(2, min(64, -(-2 * parallelism // per_chunk) + 1))
