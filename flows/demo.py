"""`rollflow demo`: the pipeline end to end against an in-process simulator and the shipped sample."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rich.console import Console

from flows.runner import EXIT_OK, run_and_print
from settings import BackendParams, CollectionSettings, RunSpec

SAMPLE = Path(__file__).resolve().parent.parent / "infra" / "data" / "sample.jsonl"


async def run_demo(
    output: str, *, parallelism: int | str, num_repeats: int, started_at: float | None = None
) -> int:
    from infra.simulator import SimConfig, start_simulator

    console = Console(stderr=True)
    sim = await start_simulator(SimConfig(slots=64, latency_ms=40.0), host="127.0.0.1", port=0)
    try:
        console.print(f"simulated backend (agent API) on {sim.url}; sample: {SAMPLE}")
        spec = RunSpec(
            input=str(SAMPLE),
            output=output,
            backend=BackendParams(kind="agent", url=sim.url),
            collection=CollectionSettings(parallelism=parallelism, num_repeats=num_repeats, chunk_size=100),
        )
        status = await asyncio.to_thread(
            run_and_print, spec, "run", progress=True, print_json=False, started_at=started_at
        )
    finally:
        await sim.close()
    if status == EXIT_OK:
        console.print(f"dataset: {spec.dataset_url()}\nreport:  {output.rstrip('/')}/report.md")
    return status
