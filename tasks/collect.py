"""chunked-collect: run one chunk's rollouts under the shared limit and commit them to the ledger."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from statistics import quantiles
from typing import Any

import orjson

from settings import BackendSettings, CollectionSettings
from tasks.backends import BackendClient, BackendError, RolloutResult
from tasks.http import session_for_loop
from tasks.ledger import ChunkManifest, Ledger
from tasks.limiter import ConcurrencyLimit
from tasks.progress import ProgressEvent, hub
from tasks.rows import ChunkSpec, iter_chunk_rows
from tasks.verifiers import Verifier

RolloutKey = tuple[int, int]


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


@dataclass
class ChunkOutcome:
    manifest: ChunkManifest
    skipped: bool
    collected: int = 0


@dataclass
class _ChunkStats:
    latencies: list[float] = field(default_factory=list)
    backend_s: float = 0.0
    verify_s: float = 0.0
    output_tokens: int = 0
    retries: int = 0
    reward_sum: float = 0.0
    reward_count: int = 0

    def as_dict(self) -> dict[str, Any]:
        lat = sorted(self.latencies)
        p50 = p95 = None
        if len(lat) >= 2:
            cuts = quantiles(lat, n=20)
            p50, p95 = cuts[9], cuts[18]
        elif lat:
            p50 = p95 = lat[0]
        return {
            "collected": len(lat),
            "latency_p50_s": p50,
            "latency_p95_s": p95,
            "backend_s": round(self.backend_s, 6),
            "verify_s": round(self.verify_s, 6),
            "output_tokens": self.output_tokens,
            "retries": self.retries,
            "reward_sum": self.reward_sum,
            "reward_count": self.reward_count,
        }


def prepare_row(row: dict[str, Any], collection: CollectionSettings) -> dict[str, Any]:
    """Apply --agent-name and --overrides the way NeMo Gym's collector does, without touching the input."""
    if collection.agent_name and not (row.get("agent_ref") or {}).get("name"):
        row = {**row, "agent_ref": {"type": "responses_api_agents", "name": collection.agent_name}}
    if collection.overrides:
        row = {**row, "responses_create_params": {**row["responses_create_params"], **collection.overrides}}
    return row


def _committed_rows(ledger: Ledger, chunk: int) -> dict[RolloutKey, bytes]:
    """The rows a partly failed chunk already holds, so a re-run redoes only its failures."""
    kept: dict[RolloutKey, bytes] = {}
    with ledger.open_chunk(chunk) as fh:
        for line in fh:
            if line.strip():
                row = orjson.loads(line)
                kept[(row["_ng_task_index"], row["_ng_rollout_index"])] = line.rstrip(b"\n")
    return kept


async def collect_chunk(ctx: CollectContext, chunk: ChunkSpec, attempt: int = 1) -> ChunkOutcome:
    """Collect every missing rollout of `chunk` and commit it; a committed, complete chunk is skipped."""
    previous = await asyncio.to_thread(ctx.ledger.manifest, chunk.index)
    if previous is not None and previous.failed == 0:
        return ChunkOutcome(previous, skipped=True)
    kept = await asyncio.to_thread(_committed_rows, ctx.ledger, chunk.index) if previous else {}
    rows = await asyncio.to_thread(lambda: list(iter_chunk_rows(ctx.input_url, chunk, ctx.input_options)))

    started_at = datetime.now(UTC).isoformat()
    t0 = time.perf_counter()
    k = ctx.collection.num_repeats
    client = BackendClient(ctx.backend, session_for_loop(ctx.backend))
    results: dict[RolloutKey, bytes] = dict(kept)
    failures: dict[RolloutKey, bytes] = {}
    stats = _ChunkStats()
    pending: set[asyncio.Task[None]] = set()

    async def one(task_index: int, row: dict[str, Any], rollout: int) -> None:
        try:
            line = await _rollout_line(ctx, client, row, task_index, rollout, stats)
            results[(task_index, rollout)] = line
            hub.emit(ProgressEvent("rollouts", done=1))
        except BackendError as exc:
            failures[(task_index, rollout)] = _failure_line(row, task_index, rollout, exc)
            hub.emit(ProgressEvent("rollouts", failed=1))
        finally:
            ctx.limit.release()

    try:
        for task_index, raw in rows:
            row = prepare_row(raw, ctx.collection)
            for rollout in range(k):
                if (task_index, rollout) in results:
                    continue
                await ctx.limit.acquire()
                t = asyncio.create_task(one(task_index, row, rollout))
                pending.add(t)
                t.add_done_callback(pending.discard)
        if pending:
            await asyncio.gather(*pending)
    except BaseException:
        for t in pending:
            t.cancel()
        raise

    collected = len(results) - len(kept)
    data = b"".join(results[key] + b"\n" for key in _ordered_keys(rows, k) if key in results)
    fail_data = b"".join(failures[key] + b"\n" for key in sorted(failures)) or None
    manifest = ChunkManifest(
        chunk=chunk.index,
        first_task=chunk.first_task,
        num_tasks=chunk.num_tasks,
        rows_expected=chunk.good_rows * k,
        rows=len(results),
        failed=len(failures),
        sha256="",
        bytes=len(data),
        started_at=started_at,
        committed_at="",
        wall_s=round(time.perf_counter() - t0, 6),
        attempt=attempt,
        stats=stats.as_dict(),
    )
    await asyncio.to_thread(ctx.ledger.commit, chunk.index, data, fail_data, manifest)
    hub.emit(ProgressEvent("chunk", chunk=chunk.index, done=len(results), failed=len(failures)))
    return ChunkOutcome(manifest, skipped=False, collected=collected)


def _ordered_keys(rows: list[tuple[int, dict[str, Any]]], k: int) -> list[RolloutKey]:
    return [(task_index, r) for task_index, _ in rows for r in range(k)]


async def _rollout_line(
    ctx: CollectContext,
    client: BackendClient,
    row: dict[str, Any],
    task_index: int,
    rollout: int,
    stats: _ChunkStats,
) -> bytes:
    """One rollout, verified, as its output JSONL line (bytes, no newline)."""
    t0 = time.perf_counter()
    result: RolloutResult = await client.rollout(row, task_index, rollout)
    t1 = time.perf_counter()
    reward = result.reward
    if reward is None and ctx.verifier is not None:
        reward = await _verify(ctx.verifier, row, result, task_index, rollout)
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


async def _verify(
    verifier: Verifier, row: dict[str, Any], result: RolloutResult, task_index: int, rollout: int
) -> float:
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
