"""Helpers for the diagnosis/tuning tests: a planned run against a real simulator, and synthetic timelines."""

from __future__ import annotations

import asyncio
import heapq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from rollout_data import write_rows

from rollflow.settings import RollflowSettings, RunSpec
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.collect.chunk import collect_chunk
from rollflow.tasks.collect.parts import chunk_part_rollouts
from rollflow.tasks.collect.plan import RunPlan, plan_run
from rollflow.tasks.collect.rollouts import CollectContext, RequestRecord
from rollflow.tasks.collect.runtime import RunHandles, collect_context, open_run
from rollflow.tasks.publish.plot import throughput_png, tuning_markdown
from rollflow.tasks.tuning.diagnose import Diagnosis
from rollflow.tasks.tuning.tune import Tuning


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


async def configure_sim(url: str, **settings: Any) -> dict[str, Any]:
    """Change a running simulator's live settings (POST /admin/config); its whole config after."""
    import aiohttp

    async with (
        aiohttp.ClientSession() as s,
        s.post(f"{url}/admin/config", data=orjson.dumps(settings)) as resp,
    ):
        body = await resp.json()
        assert resp.status == 200, body
        return body


async def assert_nothing_wasted(
    s: Setup, d: Diagnosis, t: Tuning, url: str, n_rows: int, exact_requests: bool = True
) -> None:
    """Collect the rest of the input at the chosen parallelism after `d` and `t` ran on `s`: every saved
    probe rollout is adopted, the backend is asked only for the rest (`exact_requests`: a backend without
    injected faults is asked exactly that often), every row is written or failed, and the tuning's table
    and plot render.

    Before collecting, the simulator's latency drops to 1 ms (its slots and faults unchanged): what is
    checked here is counts, not speed, and the rest of the input then takes a few seconds instead of
    up to ~16 (8 slots x 50 ms)."""
    probes = d.probe_rollouts + t.probe_rollouts
    saved = sum(
        len(chunk_part_rollouts(s.handles.ledger, c, s.plan.identity.num_repeats).kept)
        for c in s.plan.scan.chunks
    )
    await configure_sim(url, latency_ms=1.0, jitter=0.0)
    before = (await sim_metrics(url))["requests"]
    s.ctx.limit.set_limit(t.chosen_parallelism)
    try:
        outcomes = await asyncio.gather(*(collect_chunk(s.ctx, c) for c in s.plan.scan.chunks))
    finally:
        await close_loop_session()
    after = await sim_metrics(url)
    assert sum(o.adopted for o in outcomes) == saved
    rows = sum(o.manifest.rows for o in outcomes)
    assert rows + sum(o.manifest.failed for o in outcomes) == n_rows
    assert saved >= probes - sum(st.errors for st in (d.low, d.high)) - sum(x.errors for x in t.steps)
    if exact_requests:
        assert after["requests"] - before == n_rows - saved
    md = tuning_markdown(t.as_dict())
    assert "| refine |" in md or "| stability |" in md
    assert throughput_png(t.as_dict())[:4] == b"\x89PNG"
    first = orjson.loads(s.handles.ledger.store.read_bytes("chunks/00000.jsonl").splitlines()[0])
    assert first["_ng_task_index"] == 0 and "response" in first


def run(coro: Any) -> Any:
    return asyncio.run(coro)
