"""chunked-collect: run rollouts under the shared limit and commit each chunk to the ledger."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from rollflow.settings import BackendSettings, CollectionSettings
from rollflow.tasks.collect.backends import AttemptObserver, BackendClient, BackendError, RolloutResult
from rollflow.tasks.collect.http import session_for_loop
from rollflow.tasks.collect.limiter import ConcurrencyLimit
from rollflow.tasks.collect.parts import chunk_parts, delete_parts, write_part
from rollflow.tasks.collect.percentiles import percentiles
from rollflow.tasks.collect.progress import ProgressEvent, hub
from rollflow.tasks.collect.rows import ChunkSpec, iter_chunk_rows
from rollflow.tasks.collect.verifiers import Verifier
from rollflow.tasks.storage.ledger import ChunkManifest, Ledger

RolloutKey = tuple[int, int]
WorkItem = tuple[int, dict[str, Any], int]


@dataclass
class CollectContext:
    """Per-process state every chunk of a run shares: the ledger, the limit, the backend and verifier."""

    ledger: Ledger
    input_url: str
    input_options: dict[str, Any]
    backend: BackendSettings
    collection: CollectionSettings
    verifier: Verifier | None
    limit: ConcurrencyLimit
    # Optional: builds the BackendClient (tuning and adaptive mode pass one that counts every attempt).
    observers: tuple[AttemptObserver, ...] = ()


@dataclass(slots=True)
class RequestRecord:
    """When one rollout started and ended, and how it failed if it did (for throughput measurement)."""

    start: float
    end: float
    error: str | None


@dataclass
class RolloutStats:
    latencies: list[float] = field(default_factory=list)
    backend_s: float = 0.0
    verify_s: float = 0.0
    output_tokens: int = 0
    retries: int = 0
    reward_sum: float = 0.0
    reward_count: int = 0

    def as_dict(self) -> dict[str, Any]:
        p50, p95 = latency_percentiles(self.latencies)
        return {
            "collected": len(self.latencies),
            "latency_p50_s": p50,
            "latency_p95_s": p95,
            "backend_s": round(self.backend_s, 6),
            "verify_s": round(self.verify_s, 6),
            "output_tokens": self.output_tokens,
            "retries": self.retries,
            "reward_sum": self.reward_sum,
            "reward_count": self.reward_count,
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


@dataclass
class ChunkOutcome:
    manifest: ChunkManifest
    skipped: bool
    collected: int = 0
    adopted: int = 0
    core_s: float = 0.0
    task_s: float = 0.0


def prepare_row(row: dict[str, Any], collection: CollectionSettings) -> dict[str, Any]:
    """Apply --agent-name and --overrides the way NeMo Gym's collector does, without touching the input."""
    if collection.agent_name and not (row.get("agent_ref") or {}).get("name"):
        row = {**row, "agent_ref": {"type": "responses_api_agents", "name": collection.agent_name}}
    if collection.overrides:
        row = {**row, "responses_create_params": {**row["responses_create_params"], **collection.overrides}}
    return row


async def run_rollouts(
    ctx: CollectContext, items: Iterable[WorkItem], batch: RolloutBatch, limit: ConcurrencyLimit | None = None
) -> None:
    """Run every (task, row, rollout) of `items` with at most `limit` (default ctx.limit) in flight.

    Each permit drives a worker that takes the next item as soon as its rollout ends, so a slot never
    waits for another task to be scheduled; a worker gives its permit back when the items run out or
    the limit shrank below what is in use.
    """
    limit = limit or ctx.limit
    client = BackendClient(ctx.backend, session_for_loop(ctx.backend), ctx.observers)
    source = iter(items)
    pending: set[asyncio.Task[None]] = set()

    async def one(task_index: int, row: dict[str, Any], rollout: int) -> None:
        start = time.perf_counter()
        error: str | None = None
        try:
            batch.results[(task_index, rollout)] = await _rollout_line(
                ctx, client, row, task_index, rollout, batch.stats
            )
            hub.emit(ProgressEvent("rollouts", done=1))
        except BackendError as exc:
            error = exc.kind
            batch.failures[(task_index, rollout)] = _failure_line(row, task_index, rollout, exc)
            hub.emit(ProgressEvent("rollouts", failed=1))
        batch.records.append(RequestRecord(start, time.perf_counter(), error))

    async def worker(item: WorkItem) -> None:
        try:
            while True:
                await one(*item)
                if limit.in_use > limit.limit:
                    return
                nxt = next(source, None)
                if nxt is None:
                    return
                item = nxt
        finally:
            limit.release()

    try:
        for item in source:
            await limit.acquire()
            t = asyncio.create_task(worker(item))
            pending.add(t)
            t.add_done_callback(pending.discard)
        if pending:
            await asyncio.gather(*pending)
    except BaseException:
        for t in pending:
            t.cancel()
        raise


class ChunkStalled(Exception):
    """No rollout of the chunk finished for the stall timeout; the task is retried (parts kept)."""


class _Flusher:
    """Row-level resume: saves the rollouts finished since the last save as a part object.

    A kill then costs at most the requests in flight plus one flush interval; the chunk's commit
    replaces the parts. The results dict keeps insertion order, so new results are those past `saved`.
    """

    def __init__(self, ctx: CollectContext, chunk: int, batch: RolloutBatch, saved: int) -> None:
        self.ctx, self.chunk, self.batch, self.saved = ctx, chunk, batch, saved
        self.token = secrets.token_hex(3)
        self.seq = 0

    async def flush(self) -> None:
        keys = list(itertools.islice(self.batch.results, self.saved, None))
        if not keys:
            return
        lines = [self.batch.results[key] for key in keys]
        name = f"flush-{self.token}-{self.seq:05d}"
        ledger = self.ctx.ledger
        await asyncio.to_thread(write_part, ledger.store, ledger.run_id, self.chunk, name, lines)
        self.saved += len(keys)
        self.seq += 1

    async def run(self, runner: asyncio.Task[None]) -> None:
        """Wait for `runner`, flushing every interval and cancelling it if it stops making progress."""
        interval = self.ctx.collection.flush_interval_s
        stall_s = self.ctx.collection.stall_timeout_s
        tick = min(x for x in (interval, stall_s, 1.0) if x > 0)
        last_flush = last_progress = time.monotonic()
        seen = 0
        try:
            while not runner.done():
                await asyncio.wait({runner}, timeout=tick)
                now = time.monotonic()
                progress = len(self.batch.results) + len(self.batch.failures)
                if progress != seen:
                    seen, last_progress = progress, now
                elif stall_s and now - last_progress > stall_s and not runner.done():
                    runner.cancel()
                    await self.flush()
                    raise ChunkStalled(
                        f"chunk {self.chunk}: no rollout finished for {stall_s:g}s; retrying it "
                        f"({self.saved} finished rollouts kept)"
                    )
                if interval and now - last_flush >= interval and not runner.done():
                    await self.flush()
                    last_flush = now
            runner.result()
        except asyncio.CancelledError:
            runner.cancel()
            await asyncio.shield(self.flush())
            raise


def committed_rows(ledger: Ledger, manifest: ChunkManifest) -> tuple[dict[RolloutKey, bytes], list[str]]:
    """The rows a partly failed chunk already holds, so a re-run redoes only its failures.

    Only bytes that still match the manifest are adopted; a changed object is redone whole.
    """
    with ledger.open_chunk(manifest.chunk) as fh:
        data = fh.read()
    if hashlib.sha256(data).hexdigest() != manifest.sha256:
        return {}, [f"chunk {manifest.chunk}'s data does not match its manifest; all its rollouts are redone"]
    kept: dict[RolloutKey, bytes] = {}
    for line in data.splitlines():
        if line.strip():
            row = orjson.loads(line)
            kept[(row["_ng_task_index"], row["_ng_rollout_index"])] = line
    return kept, []


def _adoptable(
    ctx: CollectContext, chunk: ChunkSpec, previous: ChunkManifest | None
) -> tuple[dict[RolloutKey, bytes], list[str]]:
    """Rollouts already done for this chunk (this run's parts, a partly failed commit) and ignored parts."""
    kept, problems = chunk_parts(ctx.ledger, chunk, ctx.collection.num_repeats)
    if previous is not None:
        rows, notes = committed_rows(ctx.ledger, previous)
        kept.update(rows)
        problems += notes
    return kept, problems


async def collect_chunk(ctx: CollectContext, chunk: ChunkSpec, attempt: int = 1) -> ChunkOutcome:
    """Collect every missing rollout of `chunk` and commit it; a committed, complete chunk is skipped."""
    t_core = time.perf_counter()
    previous = await asyncio.to_thread(ctx.ledger.manifest, chunk.index)
    if previous is not None and previous.failed == 0:
        return ChunkOutcome(previous, skipped=True)
    kept, problems = await asyncio.to_thread(_adoptable, ctx, chunk, previous)
    rows = await asyncio.to_thread(lambda: list(iter_chunk_rows(ctx.input_url, chunk, ctx.input_options)))
    started_at = datetime.now(UTC).isoformat()
    t0 = time.perf_counter()
    k = ctx.collection.num_repeats
    batch = RolloutBatch(results=dict(kept))
    todo = (
        (task_index, prepare_row(row, ctx.collection), r)
        for task_index, row in rows
        for r in range(k)
        if (task_index, r) not in kept
    )
    hub.emit(ProgressEvent("rollouts", done=len(kept)))
    runner = asyncio.create_task(run_rollouts(ctx, todo, batch))
    await _Flusher(ctx, chunk.index, batch, len(kept)).run(runner)
    keys = [(task_index, r) for task_index, _ in rows for r in range(k)]
    data = b"".join(batch.results[key] + b"\n" for key in keys if key in batch.results)
    fail_data = b"".join(batch.failures[key] + b"\n" for key in sorted(batch.failures)) or None
    manifest = ChunkManifest(
        chunk=chunk.index,
        first_task=chunk.first_task,
        num_tasks=chunk.num_tasks,
        rows_expected=chunk.good_rows * k,
        rows=len(batch.results),
        failed=len(batch.failures),
        sha256="",
        bytes=len(data),
        started_at=started_at,
        committed_at="",
        wall_s=round(time.perf_counter() - t0, 6),
        attempt=attempt,
        stats={**batch.stats.as_dict(), "adopted": len(kept), "ignored_parts": problems},
    )
    await asyncio.to_thread(ctx.ledger.commit, chunk.index, data, fail_data, manifest)
    await asyncio.to_thread(delete_parts, ctx.ledger.store, chunk.index)
    hub.emit(ProgressEvent("chunk", chunk=chunk.index, done=len(batch.results), failed=len(batch.failures)))
    return ChunkOutcome(
        manifest,
        skipped=False,
        collected=len(batch.results) - len(kept),
        adopted=len(kept),
        core_s=time.perf_counter() - t_core,
    )


async def _rollout_line(
    ctx: CollectContext,
    client: BackendClient,
    row: dict[str, Any],
    task_index: int,
    rollout: int,
    stats: RolloutStats,
) -> bytes:
    """One rollout, verified, as its output JSONL line (bytes, no newline)."""
    t0 = time.perf_counter()
    result: RolloutResult = await client.rollout(row, task_index, rollout)
    t1 = time.perf_counter()
    reward = result.reward
    if reward is None and ctx.verifier is not None:
        reward = await _verify(ctx.verifier, row, result)
        stats.verify_s += time.perf_counter() - t1
    stats.backend_s += t1 - t0
    stats.latencies.append(result.latency_s)
    stats.output_tokens += result.output_tokens
    stats.retries += result.attempts - 1
    if isinstance(reward, int | float):
        stats.reward_sum += reward
        stats.reward_count += 1
    out = {**row, **result.fields}
    out["reward"] = reward
    out["_ng_task_index"] = task_index
    out["_ng_rollout_index"] = rollout
    rf: dict[str, Any] = {"attempts": result.attempts}
    if ctx.collection.record_latency:
        rf["latency_s"] = round(result.latency_s, 6)
    out["_rf"] = rf
    return orjson.dumps(out)


async def _verify(verifier: Verifier, row: dict[str, Any], result: RolloutResult) -> float:
    try:
        return await verifier(row, result)
    except BackendError:
        raise
    except Exception as exc:
        raise BackendError(
            f"verifier failed: {type(exc).__name__}: {exc}", kind="verifier", retryable=False
        ) from exc


def _failure_line(row: dict[str, Any], task_index: int, rollout: int, exc: BackendError) -> bytes:
    return orjson.dumps(
        {
            "_ng_task_index": task_index,
            "_ng_rollout_index": rollout,
            "error": {
                "kind": exc.kind,
                "status": exc.status,
                "attempts": exc.attempts,
                "message": str(exc),
            },
            "row": row,
        }
    )
