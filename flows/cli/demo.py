"""`rollflow demo`: the pipeline end to end against an in-process simulator and the shipped sample.

The simulated backend has a real capacity (32 slots x 100 ms = 320 rollouts/s, well below what the client
drives on two cores), so diagnosis finds it backend-bound, tuning finds the knee near 32, and collection
runs near capacity. 400 rows x 16 rollouts are enough that the probes are at most a quarter of the run.
"""

from __future__ import annotations

import asyncio
import json
from importlib.resources import files
from pathlib import Path

from rollflow.flows.cli.errors import EXIT_OK, stderr_console
from rollflow.flows.cli.prefect_api import PrefectApi
from rollflow.flows.cli.runner import run_and_print
from rollflow.settings import BackendParams, CollectionSettings, RunSpec, TuningSettings
from rollflow.settings.models import MAX_COUNT

SAMPLE = Path(str(files("rollflow.infra") / "data" / "sample.jsonl"))
SLOTS, LATENCY_MS, JITTER = 32, 100.0, 0.2
CAPACITY = SLOTS * 1000 / LATENCY_MS
NUM_REPEATS = 16


def capacity_line(report_path: Path) -> str:
    """How close collection came to the backend's capacity, and what tuning cost."""
    report = json.loads(report_path.read_text())
    rate = report.get("collect_rollouts_per_s") or 0.0
    probes = report.get("tuning", {}).get("total_probe_rollouts", 0)
    return (
        f"backend capacity {CAPACITY:,.0f} rollouts/s ({SLOTS} slots x {LATENCY_MS:.0f} ms); collection ran "
        f"at {rate:,.1f} ({rate / CAPACITY:.0%} of capacity); probes were {probes:,} of "
        f"{report['rows_written']:,} rollouts ({probes / max(1, report['rows_written']):.0%})"
    )


async def run_demo(
    output: str,
    *,
    parallelism: int | str,
    num_repeats: int = NUM_REPEATS,
    started_at: float | None = None,
    api: PrefectApi | None = None,
) -> int:
    from rollflow.infra.simulator import SimConfig, start_simulator

    console = stderr_console()
    config = SimConfig(slots=SLOTS, latency_ms=LATENCY_MS, jitter=JITTER)
    sim = await start_simulator(config, host="127.0.0.1", port=0)
    try:
        console.print(f"simulated backend (agent API) on {sim.url}; sample: {SAMPLE}; starting over")
        spec = RunSpec(
            input=str(SAMPLE),
            output=output,
            restart=True,
            backend=BackendParams(kind="agent", url=sim.url),
            collection=CollectionSettings(parallelism=parallelism, num_repeats=num_repeats, chunk_size=100),
            # the demo walks the pipeline's stages: diagnose and tune, then collect at the choice (a long
            # run over an engine with gauges would follow them instead; see the README)
            tuning=TuningSettings(engine_min_rollouts=MAX_COUNT),
        )
        status = await asyncio.to_thread(
            run_and_print, spec, "run", progress=True, print_json=False, started_at=started_at, api=api
        )
    finally:
        await sim.close()
    if status == EXIT_OK:
        report = Path(output) / "report.json"
        if report.exists():
            console.print(capacity_line(report), highlight=False)
        console.print(f"dataset: {spec.dataset_url()}\nreport:  {output.rstrip('/')}/report.md")
    return status
