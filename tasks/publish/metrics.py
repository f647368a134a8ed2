"""What one invocation's collection did, summed over its chunks, for the run report."""

from __future__ import annotations

from typing import Any

from rollflow.tasks.collect.chunk import ChunkOutcome
from rollflow.tasks.collect.clock import StageClock
from rollflow.tasks.collect.rollouts import CollectContext
from rollflow.tasks.publish.report import RunMetrics


def run_metrics(
    outcomes: list[ChunkOutcome], ctx: CollectContext, wall_s: float, collect_s: float, skipped: int
) -> RunMetrics:
    ran = [o for o in outcomes if not o.skipped]
    collected = sum(o.collected for o in ran)
    # latency percentiles are weighted by the rollouts each chunk attempt had answered (its samples)
    weights = [(o.manifest.stats.get("answered") or 0, o.manifest.stats) for o in ran]
    total_w = sum(w for w, _ in weights) or 1

    def weighted(key: str) -> float | None:
        vals = [(w, s[key]) for w, s in weights if s.get(key) is not None]
        return round(sum(w * v for w, v in vals) / total_w, 6) if vals else None

    return RunMetrics(
        wall_s=wall_s,
        collect_s=collect_s,
        collected=collected,
        adopted=sum(o.adopted for o in ran),
        resumed=sum(o.resumed for o in ran),
        output_tokens=sum(s.get("output_tokens", 0) for _, s in weights),
        retries=sum(s.get("retries", 0) for _, s in weights),
        # the configured or tuned value, not the limit at the end (a replica out of rotation lowers that)
        parallelism=sum(ep.limit for ep in ctx.pool.endpoints) or ctx.limit.limit,
        peak_in_flight=ctx.limit.peak,
        limit_at_end=ctx.limit.limit,
        chunks_run=len(ran),
        chunks_skipped=skipped,
        latency_p50_s=weighted("latency_p50_s"),
        latency_p95_s=weighted("latency_p95_s"),
        backend_s=sum(s.get("backend_s", 0.0) for _, s in weights),
        prefect_overhead_share=_overhead_share(ran),
        verify_s=sum(s.get("verify_s", 0.0) for _, s in weights),
    )


def _overhead_share(ran: list[ChunkOutcome]) -> float | None:
    """Share of chunk-task time spent in Prefect's task machinery rather than in the chunk's own work."""
    task_s = sum(o.task_s for o in ran)
    if task_s <= 0:
        return None
    return round(max(0.0, task_s - sum(o.core_s for o in ran)) / task_s, 6)


def overhead_figures(clock: StageClock, outcomes: list[ChunkOutcome]) -> dict[str, Any]:
    """Start-up (command start to the first backend request) and Prefect's share of the wall time so far.

    Inside the flow, Prefect's time is what came before the flow body (interpreter, imports, the Prefect
    server, the flow run's creation) plus chunk-task overhead; the CLI adds the shutdown it measures after.
    """
    wall = clock.elapsed()
    before_body = max(0.0, (clock.flow_started or clock.start) - clock.start)
    tasks_s = sum(max(0.0, o.task_s - o.core_s) for o in outcomes if not o.skipped)
    return {
        "startup_s": round(clock.stages["startup"], 3),
        "before_flow_s": round(before_body, 3),
        "chunk_task_overhead_s": round(tasks_s, 6),
        "shutdown_s": None,
        "prefect_overhead_share": round((before_body + tasks_s) / wall, 4) if wall > 0 else None,
    }
