"""The local runner's collector processes: one, or a local Dask cluster's when the client is the limit.

With more than one, the collect stage runs as `--runner dask --dask-workers N` on a local cluster
would: one share book keeps the run's one limit across them, and every chunk commits
exactly once (flows/scale_out.py). The choice and its figures go to report.json as `collectors`.
"""

from __future__ import annotations

from typing import Any

from rollflow.settings import RunSpec
from rollflow.tasks.tuning.collectors import Collectors, asked_collectors, auto_collectors, usable_cores

MIN_SECONDS_LEFT = 30.0  # a local cluster takes seconds to start: worth it for a collect this long at least


def choose_collectors(spec: RunSpec, extra: dict[str, Any], follow: bool, remaining: int) -> Collectors:
    """How many collector processes the collect stage runs, and why (always 1 off the local runner)."""
    asked = spec.collectors
    if spec.runner != "local":
        return Collectors(1, f"--runner {spec.runner}: its workers collect")
    if follow or spec.collection.parallelism == "adaptive":
        return Collectors(1, "the limit follows the backend from this process: one collector")
    if isinstance(asked, int):
        return asked_collectors(asked)
    steps = [s for s in extra.get("tuning", {}).get("steps", []) if not s.get("errors")]
    best = max(steps, key=lambda s: s["rollouts_per_s"], default=None)
    chosen = auto_collectors(best, usable_cores())
    if chosen.count > 1 and best is not None:
        seconds = remaining / max(best["rollouts_per_s"], 1e-9)
        if seconds < MIN_SECONDS_LEFT:
            why = f"{chosen.why}; but the {remaining:,} rollouts left take {seconds:.0f} s at the tuned rate"
            return Collectors(1, f"{why}, too short to start them: one collector", *_figures(chosen))
    return chosen


def _figures(c: Collectors) -> tuple[float | None, float | None]:
    return c.client_cores, c.idle_cores


def collect_spec(spec: RunSpec, collectors: Collectors) -> RunSpec:
    """The spec the collect stage runs: as given, or on a local Dask cluster of `collectors.count`
    worker processes."""
    if collectors.count <= 1 or spec.runner != "local":
        return spec
    return spec.model_copy(update={"runner": "dask", "dask_workers": collectors.count})
