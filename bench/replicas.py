"""Many replicas: rollflow's dispatch over four unequal simulator replicas, beside round-robin.

Four replicas of 16, 16, 32 and 64 slots x 100 ms (1,280 rollouts/s in all). rollflow collects the input
with per-endpoint limits of the slots plus a queue (`--queue-share`, default 0.25: what tuning with engine
metrics chooses, so a slot never waits for the client's turnaround; 0 gives limits equal to the slots),
dispatching to the least outstanding relative to the limit; round-robin, written here with aiohttp, sends
the same requests in turn to each replica at the same total parallelism, so the small replicas queue while
the big one idles: it is held to the slowest replica's pace.
Each runs once with all replicas up and once with the 64-slot replica killed mid-run and restarted on
the same port a second later. Goal: rollflow at least 0.95 of the sum with all replicas up.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
from harness import Service, spawn_simulator, write_input
from results import save

from rollflow.settings import RollflowSettings, RunSpec
from rollflow.tasks.backends.http import close_loop_session
from rollflow.tasks.collect.chunk import collect_chunk
from rollflow.tasks.collect.plan import plan_run
from rollflow.tasks.collect.runtime import collect_context, default_chunks_in_flight, open_run

SLOTS = (16, 16, 32, 64)
QUEUE_SHARE = 0.25
LATENCY_MS = 100.0
KILL_AFTER_S, DOWN_S = 3.0, 1.0


@dataclass
class Row:
    mode: str
    chaos: bool
    rollouts: int
    failed: int
    seconds: float
    capacity: float
    back_in_s: float | None = None

    @property
    def rate(self) -> float:
        return self.rollouts / self.seconds

    def line(self) -> str:
        back = "-" if self.back_in_s is None else f"{self.back_in_s:.2f}"
        chaos = "killed+restarted" if self.chaos else "all up"
        return (
            f"| {self.mode} | {chaos} | {self.rollouts:,} | {self.failed} | {self.rate:,.0f} | "
            f"{self.rate / self.capacity:.3f} | {back} |"
        )


class Replicas:
    """The four simulator processes; `bounce` kills the biggest and restarts it on its port."""

    def __init__(self, latency_ms: float) -> None:
        self.latency_ms = latency_ms
        self.capacity = sum(SLOTS) / (latency_ms / 1000)
        self.sims: list[Service] = [self._spawn(n) for n in SLOTS]
        self.returned_at: float | None = None

    def _spawn(self, slots: int, port: int | None = None) -> Service:
        return spawn_simulator("--slots", str(slots), "--latency-ms", str(self.latency_ms), port=port)

    @property
    def urls(self) -> list[str]:
        return [sim.url for sim in self.sims]

    async def bounce(self) -> None:
        await asyncio.sleep(KILL_AFTER_S)
        victim = self.sims[-1]
        victim.proc.kill()
        await asyncio.to_thread(victim.proc.wait)
        await asyncio.sleep(DOWN_S)
        port = int(victim.url.rsplit(":", 1)[1])
        self.sims[-1] = await asyncio.to_thread(self._spawn, SLOTS[-1], port)
        self.returned_at = time.time()

    def stop(self) -> None:
        for sim in self.sims:
            sim.stop()


def limits_for(queue_share: float) -> tuple[int, ...]:
    return tuple(round(n * (1 + queue_share)) for n in SLOTS)


async def rollflow_run(replicas: Replicas, inp: Path, out: Path, chaos: bool, limit: tuple[int, ...]) -> Row:
    urls = replicas.urls
    spec = RunSpec(
        input=str(inp),
        output=str(out),
        backend={"kind": "agent", "url": ",".join(urls), "backoff_base_s": 0.05},
        collection={"chunk_size": 1000, "flush_interval_s": 0},
    )
    settings = RollflowSettings()
    handles = open_run(spec, settings)
    plan = await asyncio.to_thread(plan_run, spec, handles.store, handles.ledger, handles.input_options, None)
    limits = dict(zip(urls, limit, strict=True))
    ctx = collect_context(handles, settings, limits)
    gate = asyncio.Semaphore(default_chunks_in_flight(sum(limit), 1000, 1))

    async def one(chunk: object) -> tuple[int, int]:
        async with gate:
            outcome = await collect_chunk(ctx, chunk)  # type: ignore[arg-type]
            return outcome.manifest.rows, outcome.manifest.failed

    t0 = time.perf_counter()
    bounce = asyncio.create_task(replicas.bounce()) if chaos else None
    try:
        done = await asyncio.gather(*(one(c) for c in plan.pending))
    finally:
        await close_loop_session()
    seconds = time.perf_counter() - t0
    if bounce is not None:
        await bounce
    back = None
    if chaos and replicas.returned_at is not None:
        ins = [t for kind, t in ctx.pool.endpoint(urls[-1]).events if kind == "in"]
        back = (ins[-1] - replicas.returned_at) if ins else None
    print("  rollflow endpoints:", orjson.dumps(ctx.pool.rows()).decode())
    rollouts, failed = sum(r for r, _ in done), sum(f for _, f in done)
    return Row("rollflow", chaos, rollouts, failed, seconds, replicas.capacity, back)


async def round_robin_run(replicas: Replicas, rows: list[bytes], chaos: bool, total: int) -> Row:
    """Each request to the next replica in turn; a refused connection moves on to the next one."""
    urls = [f"{url}/run" for url in replicas.urls]
    turn = itertools.count()
    source = iter(enumerate(rows))
    ok = failed = 0

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal ok, failed
        for index, body in source:
            headers = {"Content-Type": "application/json", "X-Rollflow-Task-Index": str(index)}
            for _ in range(2 * len(urls)):
                try:
                    async with session.post(urls[next(turn) % len(urls)], data=body, headers=headers) as r:
                        await r.read()
                        if r.status == 200:
                            ok += 1
                            break
                except aiohttp.ClientError:
                    continue
            else:
                failed += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        bounce = asyncio.create_task(replicas.bounce()) if chaos else None
        await asyncio.gather(*(worker(session) for _ in range(total)))
        seconds = time.perf_counter() - t0
        if bounce is not None:
            await bounce
    return Row("round-robin", chaos, ok, failed, seconds, replicas.capacity)


async def main(rollouts: int, latency_ms: float, queue_share: float) -> None:
    capacity = sum(SLOTS) / (latency_ms / 1000)
    limit = limits_for(queue_share)
    print(f"replicas {SLOTS} slots x {latency_ms:g} ms = {capacity:,.0f} rollouts/s; {rollouts:,} rollouts")
    print(f"rollflow's per-endpoint limits {limit}; round-robin at the same total, {sum(limit)} in flight")
    print("| dispatch | replicas | rollouts | failed | rollouts/s | share of sum | back in rotation s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    table: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="rf-replicas-") as tmp:
        inp = write_input(Path(tmp) / "rows.jsonl", rollouts)
        rows = inp.read_bytes().splitlines()
        for chaos in (False, True):
            for mode in ("rollflow", "round-robin"):
                replicas = Replicas(latency_ms)
                try:
                    if mode == "rollflow":
                        row = await rollflow_run(replicas, inp, Path(tmp) / f"out-{int(chaos)}", chaos, limit)
                    else:
                        row = await round_robin_run(replicas, rows, chaos, sum(limit))
                finally:
                    replicas.stop()
                print(row.line(), flush=True)
                table.append(row)
    save(
        "replicas",
        table,
        title=f"Replicas {SLOTS} slots x {latency_ms:g} ms: rollflow vs round-robin",
        params={"rollouts": rollouts, "latency_ms": latency_ms, "queue_share": queue_share, "limits": limit},
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=12_800, help="rollouts per run (default 12,800)")
    parser.add_argument(
        "--latency-ms", type=float, default=LATENCY_MS, help="replica latency (default 100: 1,280/s in all)"
    )
    parser.add_argument(
        "--queue-share",
        type=float,
        default=QUEUE_SHARE,
        help="queue over each replica's slots (default 0.25)",
    )
    args = parser.parse_args()
    asyncio.run(main(args.rollouts, args.latency_ms, args.queue_share))
