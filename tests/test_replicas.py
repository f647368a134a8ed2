"""Several simulator replicas over HTTP: load in proportion to capacity, a replica that dies and returns."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web
from local_http import AGENT, ScriptedServer
from rollout_data import assert_complete, write_rows

from rollflow.infra.local import Service, spawn_simulator
from rollflow.settings import RollflowSettings, RunSpec
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.collect.chunk import ChunkOutcome, collect_chunk
from rollflow.tasks.collect.plan import plan_run
from rollflow.tasks.collect.rollouts import CollectContext
from rollflow.tasks.collect.runtime import collect_context, default_chunks_in_flight, open_run
from rollflow.tasks.publish.audit import AuditSummary, audit_run

SLOTS = (8, 16, 32)
LATENCY_MS = "50"
BACK_WITHIN_S = 5.0


@pytest.fixture
def replicas() -> Iterator[list[Service]]:
    sims = [spawn_simulator("--slots", str(n), "--latency-ms", LATENCY_MS) for n in SLOTS]
    yield sims
    for sim in sims:
        sim.stop()


def _spec(tmp_path: Path, urls: list[str], rows: int, repeats: int, max_retries: int) -> RunSpec:
    inp = write_rows(tmp_path / "rows.jsonl", rows)
    return RunSpec(
        input=str(inp),
        output=str(tmp_path / "out"),
        backend={"kind": "agent", "url": ",".join(urls), "max_retries": max_retries, "backoff_base_s": 0.05},
        collection={"chunk_size": 100, "num_repeats": repeats, "flush_interval_s": 0},
    )


async def _collect(
    spec: RunSpec, limits: int | dict[str, int], ready: asyncio.Future[CollectContext]
) -> AuditSummary:
    """The chunks of the run, collected and committed the way the flow does, then audited.

    `limits` is each endpoint's limit, or the run's total as --parallelism gives it.
    """
    settings = RollflowSettings()
    handles = open_run(spec, settings)
    plan = await asyncio.to_thread(plan_run, spec, handles.store, handles.ledger, handles.input_options, None)
    ctx = collect_context(handles, settings, limits)
    ready.set_result(ctx)
    total = limits if isinstance(limits, int) else sum(limits.values())
    gate = asyncio.Semaphore(default_chunks_in_flight(total, 100, spec.collection.num_repeats))

    async def one(chunk: object) -> ChunkOutcome:
        async with gate:
            return await collect_chunk(ctx, chunk)  # type: ignore[arg-type]

    try:
        await asyncio.gather(*(one(c) for c in plan.pending))
    finally:
        await close_loop_session()
    manifests = await asyncio.to_thread(handles.ledger.committed)
    return await asyncio.to_thread(
        audit_run, handles.ledger, plan.scan.chunks, spec.collection.num_repeats, manifests
    )


def _dataset(out: Path) -> list[bytes]:
    return [line for p in sorted((out / "chunks").glob("*.jsonl")) for line in p.read_bytes().splitlines()]


@pytest.mark.alone  # shares of load follow measured rates
def test_load_follows_capacity(replicas, tmp_path):
    urls = [sim.url for sim in replicas]
    rows, repeats = 600, 4
    spec = _spec(tmp_path, urls, rows, repeats, max_retries=2)
    limits = dict(zip(urls, SLOTS, strict=True))

    async def main() -> tuple[AuditSummary, CollectContext]:
        ready: asyncio.Future[CollectContext] = asyncio.get_running_loop().create_future()
        summary = await _collect(spec, limits, ready)
        return summary, ready.result()

    summary, ctx = asyncio.run(main())
    assert summary.ok and summary.failed == 0, summary.problems
    assert_complete(_dataset(tmp_path / "out"), rows, repeats)
    served = {row["url"]: row["rollouts"] for row in ctx.pool.rows()}
    assert sum(served.values()) == rows * repeats
    for url, slots in limits.items():
        expected = slots / sum(SLOTS)
        share = served[url] / (rows * repeats)
        assert abs(share - expected) <= 0.15 * expected, (url, share, expected, served)


@pytest.mark.alone  # back in rotation within 5 s
def test_replica_killed_and_restarted(replicas, tmp_path):
    """No retry left (max_retries 0): a rollout lost to the dead replica would show as a failure."""
    urls = [sim.url for sim in replicas]
    rows, repeats = 2000, 4
    spec = _spec(tmp_path, urls, rows, repeats, max_retries=0)
    limits = dict(zip(urls, SLOTS, strict=True))
    victim = replicas[-1]
    port = int(victim.url.rsplit(":", 1)[1])
    times: dict[str, float] = {}

    async def chaos(ready: asyncio.Future[CollectContext]) -> CollectContext:
        ctx = await ready
        deadline = time.monotonic() + 60
        while ctx.pool.endpoint(victim.url).rollouts < 500 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        victim.proc.kill()
        await asyncio.to_thread(victim.proc.wait)
        times["killed"] = time.time()
        await asyncio.sleep(1.0)
        replicas[-1] = await asyncio.to_thread(
            spawn_simulator, "--slots", "32", "--latency-ms", LATENCY_MS, port=port
        )
        times["returned"] = time.time()
        times["served_at_return"] = ctx.pool.endpoint(victim.url).rollouts
        return ctx

    async def main() -> tuple[AuditSummary, CollectContext]:
        ready: asyncio.Future[CollectContext] = asyncio.get_running_loop().create_future()
        summary, ctx = await asyncio.gather(_collect(spec, limits, ready), chaos(ready))
        return summary, ctx

    summary, ctx = asyncio.run(main())
    assert summary.ok and summary.failed == 0 and summary.duplicates == 0, summary.problems
    assert_complete(_dataset(tmp_path / "out"), rows, repeats)
    ep = ctx.pool.endpoint(victim.url)
    outs = [t for kind, t in ep.events if kind == "out" and t >= times["killed"] - 0.5]
    ins = [t for kind, t in ep.events if kind == "in" and outs and t > outs[0]]
    assert outs and ins, ep.events
    assert ins[-1] <= times["returned"] + BACK_WITHIN_S, (ins, times)
    assert ep.in_rotation and ep.rollouts > times["served_at_return"] + 100, (ep.rollouts, times)
    assert ep.out_of_rotation_s >= 1.0 and ep.errors > 0


@dataclass
class InFlight:
    """Requests under way across several servers at once, and the most seen together."""

    now: int = 0
    peak: int = 0

    def handler(self, latency_s: float) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            self.now += 1
            self.peak = max(self.peak, self.now)
            try:
                await asyncio.sleep(latency_s)
            finally:
                self.now -= 1
            return web.json_response(AGENT)

        return handle


async def test_a_total_below_the_endpoints_is_never_exceeded(tmp_path):
    """--parallelism 2 with 3 URLs gave each URL a slot: 3 requests in flight. Every URL must still serve."""
    servers = [ScriptedServer() for _ in range(3)]
    gauge = InFlight()
    urls = [await srv.start(gauge.handler(0.02)) for srv in servers]
    rows = 60
    spec = _spec(tmp_path, urls, rows, repeats=1, max_retries=0)
    ready: asyncio.Future[CollectContext] = asyncio.get_running_loop().create_future()
    try:
        summary = await _collect(spec, 2, ready)
    finally:
        for srv in servers:
            await srv.stop()
    assert summary.ok and summary.failed == 0, summary.problems
    assert gauge.peak == 2, gauge.peak
    assert all(srv.seen for srv in servers), [len(srv.seen) for srv in servers]
    assert sum(row["rollouts"] for row in ready.result().pool.rows()) == rows
