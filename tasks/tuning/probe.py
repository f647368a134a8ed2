"""Probe steps: real rollouts of the input at one parallelism, measured, and kept as parts.

Diagnosis, tuning and the stability check all run through `probe_step`. Its rollouts are rollouts of
the dataset (same backend, same sampling parameters), so each successful one is saved as a part of the
chunk that owns its task; the chunk adopts it instead of asking again. Failures are not saved: the chunk
retries them. `ProbeFeed` hands out fresh work items in task order so no step repeats another's rows.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from rollflow.tasks.backends.engine_metrics import EngineSampler
from rollflow.tasks.backends.limiter import ConcurrencyLimit
from rollflow.tasks.backends.observe import AttemptLog, rate_limited
from rollflow.tasks.collect.chunk import committed_rows
from rollflow.tasks.collect.parts import PROBE, chunk_part_rollouts, write_part
from rollflow.tasks.collect.plan import RunPlan
from rollflow.tasks.collect.rollouts import (
    CollectContext,
    RequestRecord,
    RolloutBatch,
    RolloutKey,
    WorkItem,
    prepare_row,
    run_rollouts,
)
from rollflow.tasks.collect.rows import ChunkSpec, iter_chunk_rows
from rollflow.tasks.collect.settle import first_rollouts
from rollflow.tasks.storage.ledger import Ledger
from rollflow.tasks.tuning.collectors import machine_busy_s
from rollflow.tasks.tuning.engine import EngineStep, engine_step, fed_window, sample_mid_step
from rollflow.tasks.tuning.fail_fast import all_failed, first_failure, rejection, until_all_fail
from rollflow.tasks.tuning.throughput import StepMeasure, combine_measures, measure_step

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """One probe step: its steady measurement plus where the time went and what was kept."""

    label: str
    parallelism: int
    measure: StepMeasure
    backend_s: float = 0.0
    verify_s: float = 0.0
    retries: int = 0
    attempt_errors: dict[str, int] = field(default_factory=dict)
    saved: int = 0
    records: list[RequestRecord] = field(default_factory=list, repr=False)
    engine: EngineStep | None = None
    first_failure: str = ""  # the first failed rollout's message: what a failed tuning names
    # What the checks took (CPU, busy time) and the collecting process's CPU, over the step's wall time.
    usage: VerifyUsage = field(default_factory=lambda: VerifyUsage())

    @property
    def rollouts_per_s(self) -> float:
        return self.measure.rollouts_per_s

    @property
    def rollouts(self) -> int:
        return self.measure.rollouts

    @property
    def errors(self) -> int:
        return self.measure.error_count

    @property
    def attempts(self) -> int:
        """Every request sent, retries included: the successes plus each failed attempt."""
        return self.measure.ok + sum(self.attempt_errors.values())

    @property
    def attempt_error_rate(self) -> float:
        return sum(self.attempt_errors.values()) / self.attempts if self.attempts else 0.0

    @property
    def rate_limited(self) -> int:
        """429 answers, counting those a retry later got past."""
        return rate_limited(self.attempt_errors)

    def per_rollout(self, seconds: float) -> float:
        return seconds / self.measure.ok if self.measure.ok else 0.0

    def as_dict(self) -> dict[str, Any]:
        m = self.measure
        return {
            "label": self.label,
            "parallelism": self.parallelism,
            "rollouts": m.rollouts,
            "ok": m.ok,
            "rollouts_per_s": round(m.rollouts_per_s, 3),
            "latency_p50_s": None if m.p50_s is None else round(m.p50_s, 6),
            "latency_p95_s": None if m.p95_s is None else round(m.p95_s, 6),
            "errors": m.error_count,
            "errors_by_kind": dict(m.errors),
            "attempt_errors": dict(self.attempt_errors),
            "retries": self.retries,
            "backend_s": round(self.backend_s, 6),
            "verify_s": round(self.verify_s, 6),
            "wall_s": round(m.wall_s, 6),
            "window_s": round(m.window_s, 6),
            "method": m.method,
            "rollouts_per_s_err": round(m.reported_err, 3),
            "saved": self.saved,
            **({"engine": self.engine.as_dict()} if self.engine is not None else {}),
        }


def merge_steps(steps: Sequence[StepResult]) -> StepResult:
    """Steps at one parallelism (a step and its extensions) as one measurement."""
    if len(steps) == 1:
        return steps[0]
    attempt_errors: dict[str, int] = {}
    for st in steps:
        for kind, n in st.attempt_errors.items():
            attempt_errors[kind] = attempt_errors.get(kind, 0) + n
    records = [r for st in steps for r in st.records]
    return StepResult(
        label="+".join(st.label for st in steps),
        parallelism=steps[0].parallelism,
        measure=combine_measures([st.measure for st in steps], records),
        backend_s=sum(st.backend_s for st in steps),
        verify_s=sum(st.verify_s for st in steps),
        retries=sum(st.retries for st in steps),
        attempt_errors=attempt_errors,
        saved=sum(st.saved for st in steps),
        records=records,
        engine=steps[-1].engine,
        usage=VerifyUsage.total([st.usage for st in steps]),
    )


def chunk_of(chunks: Sequence[ChunkSpec], task_index: int) -> ChunkSpec:
    """The chunk whose task range holds `task_index` (chunks sorted by first_task)."""
    starts = [c.first_task for c in chunks]
    i = bisect.bisect_right(starts, task_index) - 1
    if i < 0 or task_index >= chunks[i].first_task + chunks[i].num_tasks:
        raise KeyError(f"task {task_index} is in no chunk of the plan")
    return chunks[i]


def save_parts(
    ledger: Ledger, chunks: Sequence[ChunkSpec], results: dict[RolloutKey, bytes], label: str
) -> int:
    """Write the rollouts as one probe part per owning chunk (marked with this command's session)."""
    by_chunk: dict[int, list[tuple[RolloutKey, bytes]]] = {}
    for key, line in results.items():
        by_chunk.setdefault(chunk_of(chunks, key[0]).index, []).append((key, line))
    name = f"{label}-{uuid.uuid4().hex[:8]}"
    for index, entries in by_chunk.items():
        lines = [line for _, line in sorted(entries)]
        write_part(ledger.store, ledger.run_id, index, name, lines, PROBE, ledger.session)
    return len(results)


async def probe_step(
    ctx: CollectContext,
    items: list[WorkItem],
    parallelism: int,
    *,
    chunks: Sequence[ChunkSpec],
    label: str = "probe",
    engine: EngineSampler | None = None,
    sample_delay_s: float | None = None,
) -> StepResult:
    """Run `items` at exactly `parallelism` in flight (own limit), measure, and save the successes as parts.

    With an engine sampler that has a signal, one sample is taken mid-step (`sample_delay_s` after the
    start, or half a latency after the first reply) and the step carries the engine's figures.
    Parts are saved even if the step is interrupted, so nothing that finished is lost. A step whose
    first FAIL_FAST rollouts all failed stops there and raises BackendRejects (fail_fast.py).
    """
    log = AttemptLog()
    step_ctx = dataclasses.replace(ctx, observers=(*ctx.observers, log))
    usage = VerifyUsage.start(ctx.verifier)
    batch = RolloutBatch()
    saved = 0
    watch: asyncio.Task[None] | None = None
    if engine is not None and await engine.reserve():
        started = time.perf_counter()
        watch = asyncio.create_task(sample_mid_step(engine, batch.records, started, sample_delay_s))
    try:
        await run_rollouts(step_ctx, until_all_fail(items, batch), batch, ConcurrencyLimit(parallelism))
    finally:
        usage = usage.stop(ctx.verifier)  # the rollouts only: saving parts is no verification time
        if watch is not None and engine is not None:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
            engine.release()
        results = dict(batch.results)
        saved = await asyncio.to_thread(save_parts, ctx.ledger, chunks, results, label)
    if all_failed(batch):
        raise rejection(batch, parallelism)
    seen = None
    if watch is not None and engine is not None:
        seen = engine_step(fed_window(engine, batch.records, started, sample_delay_s))
    return StepResult(
        label=label,
        parallelism=parallelism,
        measure=measure_step(batch.records, parallelism),
        backend_s=batch.stats.backend_s,
        verify_s=batch.stats.verify_s,
        retries=batch.stats.retries,
        attempt_errors=dict(log.errors),
        saved=saved,
        records=batch.records,
        engine=seen,
        usage=usage,
        first_failure=first_failure(batch),
    )


@dataclass
class VerifyUsage:
    """What a step's checks took (CPU and busy seconds of the processes or threads running them, and how
    many) and the collecting process's CPU, over the step's rollouts: what tells a verification limit
    from the backend's."""

    verify_cpu_s: float = 0.0
    verify_busy_s: float = 0.0
    checks: int = 0
    process_cpu_s: float = 0.0
    wall_s: float = 0.0
    machine_busy_s: float | None = None  # every core's busy seconds (None: the platform does not say)

    @classmethod
    def start(cls, verifier: Any) -> VerifyUsage:
        return cls(*_checks(verifier), time.process_time(), time.perf_counter(), machine_busy_s())

    def stop(self, verifier: Any) -> VerifyUsage:
        cpu, busy, checks = _checks(verifier)
        now = machine_busy_s()
        return VerifyUsage(
            cpu - self.verify_cpu_s,
            busy - self.verify_busy_s,
            checks - self.checks,
            time.process_time() - self.process_cpu_s,
            time.perf_counter() - self.wall_s,
            None if now is None or self.machine_busy_s is None else now - self.machine_busy_s,
        )

    def cores(self) -> dict[str, float]:
        """The collecting process's and the machine's busy cores over the step (see tuning/collectors)."""
        if self.wall_s <= 0:
            return {}
        busy = (
            {} if self.machine_busy_s is None else {"busy_cores": round(self.machine_busy_s / self.wall_s, 3)}
        )
        return {"client_cores": round(self.process_cpu_s / self.wall_s, 3), **busy}

    @classmethod
    def total(cls, parts: Sequence[VerifyUsage]) -> VerifyUsage:
        fields = ("verify_cpu_s", "verify_busy_s", "checks", "process_cpu_s", "wall_s")
        machine = [p.machine_busy_s for p in parts]
        busy = None if None in machine else sum(m for m in machine if m is not None)
        return cls(*(sum(getattr(p, f) for p in parts) for f in fields), machine_busy_s=busy)


def _checks(verifier: Any) -> tuple[float, float, int]:
    usage = getattr(verifier, "usage", None)
    return usage() if callable(usage) else (0.0, 0.0, 0)


class ProbeFeed:
    """The next N work items of the input in task order across pending chunks, never handed out twice.

    Keys already held by a committed chunk or a saved part are skipped, so a resumed run probes fresh
    rows. Rows are read one chunk at a time (constant memory).
    """

    def __init__(self, ctx: CollectContext, plan: RunPlan) -> None:
        self.ctx = ctx
        self.plan = plan
        self.handed_out = 0
        self._items = self._generate()
        # `next` reads in a worker thread that outlives a cancelled await: the generator is touched only
        # under this lock, and `close` never waits for it (see `close`).
        self._reading = threading.Lock()
        self._closed = False

    def _generate(self) -> Iterator[WorkItem]:
        k = self.ctx.collection.num_repeats
        first = first_rollouts(self.ctx.collection)  # with settling, a probe never asks past a task's first M
        for chunk in self.plan.pending:
            done: set[RolloutKey] = set(chunk_part_rollouts(self.ctx.ledger, chunk, k).kept)
            if chunk.index in self.plan.committed:
                done |= set(committed_rows(self.ctx.ledger, self.plan.committed[chunk.index])[0])
            for task_index, row in iter_chunk_rows(
                self.ctx.input_url,
                chunk,
                self.ctx.input_options,
                self.ctx.backend.kind.value,
                self.ctx.collection.overrides,
            ):
                prepared = prepare_row(row, self.ctx.collection, self.ctx.backend.sources)
                for r in range(first):
                    if (task_index, r) not in done:
                        yield task_index, prepared, r

    def take(self, n: int) -> list[WorkItem]:
        with self._reading:
            items = [] if self._closed else list(islice(self._items, max(0, n)))
            self.handed_out += len(items)
        if self._closed:
            self._close_if_idle()
        return items

    async def next(self, n: int) -> list[WorkItem]:
        """Up to `n` fresh items (fewer when the input runs out), read off the event loop."""
        return await asyncio.to_thread(self.take, n)

    def close(self) -> None:
        """Stop reading; never raises for a read still running (a cancelled `next`'s thread).

        It is called in `finally` blocks while another error propagates, so it must not replace that
        error: a read under way closes the generator itself when it ends.
        """
        self._closed = True
        self._close_if_idle()

    def _close_if_idle(self) -> None:
        # Whichever of `close` and the last `take` finds the lock free closes the generator (idempotent).
        # A failure to release the input is logged, not raised: it would hide the error being handled.
        if not self._reading.acquire(blocking=False):
            return
        try:
            self._items.close()
        except Exception:
            log.warning("closing the probe feed's input failed", exc_info=True)
        finally:
            self._reading.release()


async def probe_next(
    ctx: CollectContext,
    plan: RunPlan,
    feed: ProbeFeed,
    parallelism: int,
    rollouts: int,
    label: str,
    engine: EngineSampler | None = None,
    sample_delay_s: float | None = None,
) -> StepResult | None:
    """A step on the next `rollouts` fresh items; None when the input has none left."""
    items = await feed.next(rollouts)
    if not items:
        return None
    return await probe_step(
        ctx, items, parallelism, chunks=plan.scan.chunks, label=label, engine=engine,
        sample_delay_s=sample_delay_s,
    )  # fmt: skip
