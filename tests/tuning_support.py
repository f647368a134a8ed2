"""Helpers for the diagnosis/tuning tests: a planned run against a real simulator, and synthetic timelines."""

from __future__ import annotations

import asyncio
import heapq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_data import write_rows

from rollflow.settings import RollflowSettings, RunSpec
from rollflow.tasks.collect.plan import RunPlan, plan_run
from rollflow.tasks.collect.rollouts import CollectContext, RequestRecord
from rollflow.tasks.wrappers.runtime import RunHandles, collect_context, open_run


@dataclass
class Setup:
    ctx: CollectContext
    plan: RunPlan
    handles: RunHandles


def setup_run(
    tmp_path: Path,
    url: str,
    rows: int = 3000,
    kind: str = "agent",
    chunk_size: int = 500,
    verifier: str = "math",
    verify_processes: int | None = None,
    **backend: Any,
) -> Setup:
    inp = write_rows(tmp_path / "in.jsonl", rows)
    spec = RunSpec(
        input=str(inp),
        output=str(tmp_path / "out"),
        backend={"kind": kind, "url": url, "model": "sim", **backend},
        collection={"chunk_size": chunk_size},
        verify={"verifier": verifier, "processes": verify_processes},
    )
    return _setup(spec)


def _setup(spec: RunSpec) -> Setup:
    settings = RollflowSettings()
    handles = open_run(spec, settings)
    plan = plan_run(spec, handles.store, handles.ledger, handles.input_options, None)
    return Setup(collect_context(handles, settings, 1), plan, handles)


def closed_loop(n: int, parallelism: int, slots: int, latency: float, t0: float = 0.0) -> list[RequestRecord]:
    """The timeline of n requests, `parallelism` in flight, served FIFO by `slots` servers of `latency`."""
    servers = [t0] * slots
    heapq.heapify(servers)
    ends: list[float] = []
    records = []
    for i in range(n):
        arrive = t0 if i < parallelism else ends[i - parallelism]
        start = max(arrive, heapq.heappop(servers))
        end = start + latency
        heapq.heappush(servers, end)
        ends.append(end)
        records.append(RequestRecord(arrive, end, None))
    return records


async def sim_metrics(url: str) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(f"{url}/stats") as resp:
        return await resp.json()


def run(coro: Any) -> Any:
    return asyncio.run(coro)
