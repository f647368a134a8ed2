"""Running rollouts under a shared limit: the context every chunk shares, the per-rollout work and its
output and failure lines, and the timings the throughput measurement reads."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rollflow.settings import BackendSettings, CollectionSettings, redact
from rollflow.tasks.backends.backends import BackendClient, BackendError, RolloutResult
from rollflow.tasks.backends.endpoints import EndpointPool, split_limit
from rollflow.tasks.backends.http import session_for_loop
from rollflow.tasks.backends.limiter import ConcurrencyLimit
from rollflow.tasks.backends.observe import AttemptObserver
from rollflow.tasks.collect.failures import failure_line, rollflow_fields
from rollflow.tasks.collect.percentiles import percentiles
from rollflow.tasks.collect.progress import ProgressEvent, hub
from rollflow.tasks.collect.routing import agent_map_of, routed, row_agent
from rollflow.tasks.collect.seeds import seeded
from rollflow.tasks.storage import rowjson
from rollflow.tasks.storage.ledger import Ledger
from rollflow.tasks.storage.rowjson import RolloutKey
from rollflow.tasks.verify.verifiers import Verifier

WorkItem = tuple[int, dict[str, Any], int]


@dataclass
class CollectContext:
    """Per-process state every chunk of a run shares: the ledger, the limit, the backend and verifier.

    `pool` holds the backend's endpoints; it keeps `limit`, the one bound workers take, at the in-rotation
    limits' sum, never above all limits' sum. Left out, it is built with `limit` split evenly over the
    backend's URLs (0 fixed slots for some when there are fewer slots than URLs).
    """

    ledger: Ledger
    input_url: str
    input_options: dict[str, Any]
    backend: BackendSettings
    collection: CollectionSettings
    verifier: Verifier | None
    limit: ConcurrencyLimit
    # Optional: builds the BackendClient (tuning and adaptive mode pass one that counts every attempt).
    observers: tuple[AttemptObserver, ...] = ()
    pool: EndpointPool = field(default=None)  # type: ignore[assignment]
    run: str | None = None  # names the run in progress events (a worker process serves several runs)
    correct_threshold: float = 1.0  # a rollout is correct at reward >= this (statistics and settling)

    def __post_init__(self) -> None:
        if self.pool is None:
            urls = self.backend.urls
            limits = split_limit(self.limit.limit, urls)
            self.pool = EndpointPool(urls, limits, self.limit, self.backend.groups())
        key = self.backend.api_key.get_secret_value() if self.backend.api_key is not None else ""
        redact.register(None, key)

    def scrub(self, text: str) -> str:
        """Every secret of the process replaced, whatever error produced the text."""
        return redact.redact(text)


@dataclass(slots=True)
class RequestRecord:
    """When one rollout started and ended, and how it failed if it did (for throughput measurement)."""

    start: float
    end: float
    error: str | None
    tokens: int = 0  # output tokens of a successful rollout, when the backend reports them


@dataclass
class RolloutStats:
    """Figures of the rollouts one attempt got answered (a latency each) and rewarded; a chunk's manifest
    keeps them, its count as `answered` (not the chunk's `collected`, which also counts saved parts)."""

    latencies: list[float] = field(default_factory=list)
    backend_s: float = 0.0
    verify_s: float = 0.0
    output_tokens: int = 0
    retries: int = 0

    def as_dict(self) -> dict[str, Any]:
        p50, p95 = latency_percentiles(self.latencies)
        return {
            "answered": len(self.latencies),
            "latency_p50_s": p50,
            "latency_p95_s": p95,
            "backend_s": round(self.backend_s, 6),
            "verify_s": round(self.verify_s, 6),
            "output_tokens": self.output_tokens,
            "retries": self.retries,
        }


def latency_percentiles(latencies: list[float]) -> tuple[float | None, float | None]:
    p50, p95 = percentiles(latencies)
    return (None if p50 is None else round(p50, 6)), (None if p95 is None else round(p95, 6))


@dataclass
class RolloutBatch:
    """What a set of rollouts produced: output lines and failure lines by (task, rollout), and timings."""

    results: dict[RolloutKey, bytes] = field(default_factory=dict)
    failures: dict[RolloutKey, bytes] = field(default_factory=dict)
    stats: RolloutStats = field(default_factory=RolloutStats)
    records: list[RequestRecord] = field(default_factory=list)
    rewards: dict[RolloutKey, float] = field(default_factory=dict)  # of `results` answered here (settling)


def prepare_row(
    row: dict[str, Any], collection: CollectionSettings, sources: dict[str, str] | None = None
) -> dict[str, Any]:
    """Apply +agent_name, agent_map (and task_source `sources`) and --overrides the way NeMo Gym's
    collector does (the input stays)."""
    row = routed(row, agent_map_of(collection.agent_name, collection.agent_map), sources)
    if collection.overrides:
        row = {**row, "responses_create_params": {**row["responses_create_params"], **collection.overrides}}
    return row


async def run_rollouts(
    ctx: CollectContext,
    items: Iterable[WorkItem],
    batch: RolloutBatch,
    limit: ConcurrencyLimit | None = None,
    *,
    chunk: int | None = None,
) -> None:
    """Run every (task, row, rollout) of `items` with at most `limit` (default ctx.limit) in flight.

    Progress events name `chunk`; probes pass none, since their rollouts count when a chunk adopts them.

    Each permit drives a worker that takes the next item as soon as its rollout ends, so a slot never
    waits for another task to be scheduled; a worker gives its permit back when the items run out or
    the limit shrank below what is in use.
    """
    limit = limit or ctx.limit
    client = BackendClient(ctx.backend, session_for_loop(), ctx.observers, ctx.pool)
    source = iter(items)

    async def worker(item: WorkItem) -> None:
        while True:
            await _run_one(ctx, client, batch, item, chunk)
            if limit.in_use > limit.limit:
                return
            nxt = next(source, None)
            if nxt is None:
                return
            item = nxt

    await _worker_per_permit(source, limit, worker)


async def _worker_per_permit(
    source: Iterator[WorkItem], limit: ConcurrencyLimit, worker: Callable[[WorkItem], Awaitable[None]]
) -> None:
    """Start a worker on the next item whenever a permit is free; wait for all, or cancel all on error.

    Each worker's permit is given back by its task's done callback, which runs even for a task cancelled
    before its first step (a `finally` inside the worker would never run then, and the shared limit of a
    worker process would lose that permit for good).
    """
    pending: set[asyncio.Task[None]] = set()

    def finished(t: asyncio.Task[None]) -> None:
        pending.discard(t)
        limit.release()

    try:
        for item in source:
            await limit.acquire()
            t = asyncio.create_task(worker(item))
            pending.add(t)
            t.add_done_callback(finished)
        if pending:
            await asyncio.gather(*pending)
    except BaseException:
        for t in pending:
            t.cancel()
        raise


async def _run_one(
    ctx: CollectContext, client: BackendClient, batch: RolloutBatch, item: WorkItem, chunk: int | None
) -> None:
    """One rollout into `batch`: its output line, or its failure line; either way its timing record."""
    task_index, row, rollout = item
    start = time.perf_counter()
    error: str | None = None
    tokens = 0
    key = (task_index, rollout)
    try:
        batch.results[key], tokens, batch.rewards[key] = await _rollout_line(
            ctx, client, row, task_index, rollout, batch.stats
        )
        hub.emit(ProgressEvent("rollouts", done=1, chunk=chunk, run=ctx.run))
    except Exception as exc:
        failure = exc if isinstance(exc, BackendError) else _unexpected(exc)
        error = failure.kind
        batch.failures[key] = _failure_line(ctx, row, task_index, rollout, failure)
        hub.emit(ProgressEvent("rollouts", failed=1, chunk=chunk, run=ctx.run))
    batch.records.append(RequestRecord(start, time.perf_counter(), error, tokens))


async def _rollout_line(
    ctx: CollectContext,
    client: BackendClient,
    row: dict[str, Any],
    task_index: int,
    rollout: int,
    stats: RolloutStats,
) -> tuple[bytes, int, float]:
    """One rollout, verified, as its output JSONL line (bytes, no newline), its output tokens and reward."""
    t0 = time.perf_counter()
    sent, seed = _seeded(ctx, row, task_index, rollout)
    result: RolloutResult = await client.rollout(sent, task_index, rollout)
    t1 = time.perf_counter()
    reward = result.reward
    if reward is None and ctx.verifier is not None:
        try:
            reward = await _verify(ctx.verifier, row, result)
        except BackendError as exc:
            exc.output = result.fields  # type: ignore[attr-defined]  # kept: `reverify --failed-only` rescores it
            raise
        stats.verify_s += time.perf_counter() - t1
    check_reward(reward, result.attempts)
    stats.backend_s += t1 - t0
    stats.latencies.append(result.latency_s)
    stats.output_tokens += result.output_tokens
    stats.retries += result.attempts - 1
    out = {**row, **result.fields}
    if "agent_ref" in row:  # the agent the row was sent to, whatever the reply echoes
        out["agent_ref"] = row["agent_ref"]
    out["reward"] = reward
    out["_ng_task_index"] = task_index
    out["_ng_rollout_index"] = rollout
    out.update(server_fields(ctx.backend, row))
    out["_rf"] = rf = rollflow_fields(result.attempts, seed)
    if ctx.collection.record_latency:
        rf["latency_s"] = round(result.latency_s, 6)
    return rowjson.dumps(out), result.output_tokens, reward


async def _verify(verifier: Verifier, row: dict[str, Any], result: RolloutResult) -> float:
    try:
        return await verifier(row, result)
    except BackendError:
        raise
    except Exception as exc:
        raise BackendError(
            f"verifier failed: {type(exc).__name__}: {exc}", kind="verifier", retryable=False
        ) from exc


NO_VERIFIER = (
    "the backend gave none and no verifier is set (--verifier scores the replies that carry no reward, an "
    "agent's too)"
)


def check_reward(reward: Any, attempts: int, none: str = NO_VERIFIER) -> float:
    """A rollout without a finite number as its reward is a failure (no_reward), for collection and
    reverify alike; `none` says why a reward of None came."""
    if not rowjson.is_reward(reward):
        why = none if reward is None else f"it is {reward!r}"
        raise BackendError(f"no numeric reward: {why}", kind="no_reward", attempts=attempts)
    return reward


def _unexpected(exc: Exception) -> BackendError:
    """Any other error while building, sending, verifying or storing one rollout: that rollout's failure."""
    return BackendError(f"{type(exc).__name__}: {exc}", kind="rollout_error")


def _seeded(
    ctx: CollectContext, row: dict[str, Any], task_index: int, rollout: int
) -> tuple[dict[str, Any], Any]:
    """The row as sent and its seed, by the run's seed settings (an agent row's in metadata.extra_body)."""
    col = ctx.collection
    agent = ctx.backend.kind == "agent"
    return seeded(row, col.seed, task_index, rollout, agent=agent, repeat_seed=col.repeat_seed)


def server_fields(backend: BackendSettings, row: dict[str, Any]) -> dict[str, Any]:
    """NeMo Gym's names of the server that ran the row and its type, when the head server gave them."""
    server = backend.agents.get(row_agent(row) or "") if backend.agents else None
    if server is None:
        return {}
    found: dict[str, Any] = {}
    if server.server is not None:
        found["_ng_environment_server"] = server.server
    if server.server_type is not None:
        found["_ng_result_type"] = server.server_type
    return found


def _failure_line(
    ctx: CollectContext, row: dict[str, Any], task_index: int, rollout: int, exc: BackendError
) -> bytes:
    output = getattr(exc, "output", None)
    rf = (
        rollflow_fields(exc.attempts, _seeded(ctx, row, task_index, rollout)[1])
        if output is not None
        else None
    )
    extra = server_fields(ctx.backend, row)
    return failure_line((task_index, rollout), exc, row, ctx.scrub, output=output, rf=rf, extra=extra)
