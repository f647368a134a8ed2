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


def choose_collectors(
    spec: RunSpec, extra: dict[str, Any], follow: bool, remaining: int, chunks: int
) -> Collectors:
    """How many collector processes the collect stage runs, and why (always 1 off the local runner; never
    more than the `chunks` pending, each of which one process collects)."""
    chosen = _choose(spec, extra, follow, remaining)
    if chosen.count > max(1, chunks):
        why = f"{chosen.why}; {chunks} chunk{'s' * (chunks != 1)} pending"
        return Collectors(max(1, chunks), why, *_figures(chosen))
    return chosen


def _choose(spec: RunSpec, extra: dict[str, Any], follow: bool, remaining: int) -> Collectors:
    asked = spec.collectors
    if spec.runner != "local":
        return Collectors(1, f"--runner {spec.runner}: its workers collect")
    if follow or spec.collection.parallelism == "adaptive":
        return Collectors(1, "the limit follows the backend from this process: one collector")
    if isinstance(asked, int):
        return asked_collectors(asked)
    at = chosen_step(extra.get("tuning", {}))
    chosen = auto_collectors(at, usable_cores())  # judged at the level collection runs at
    if chosen.count > 1 and at is not None:
        seconds = remaining / max(at["rollouts_per_s"], 1e-9)
        if seconds < MIN_SECONDS_LEFT:
            why = f"{chosen.why}; but the {remaining:,} rollouts left take {seconds:.0f} s at the tuned rate"
            return Collectors(1, f"{why}, too short to start them: one collector", *_figures(chosen))
    return chosen


def chosen_step(tuning: dict[str, Any]) -> dict[str, Any] | None:
    """The readings at the level the tuner chose, as one; with several endpoints (tuned at once, in this
    process) their levels and rates summed, the busiest client and machine readings kept."""
    if "endpoints" not in tuning:
        return _at_level(tuning)
    each = [_at_level(t) for t in tuning["endpoints"]]
    if not each or any(e is None for e in each):
        return None
    steps = [e for e in each if e is not None]
    step: dict[str, Any] = {
        "parallelism": sum(e["parallelism"] for e in steps),
        "rollouts_per_s": sum(e["rollouts_per_s"] for e in steps),
    }
    for key in ("client_cores", "busy_cores"):  # process- and machine-wide figures: not summed
        if all(key in e for e in steps):
            step[key] = max(e[key] for e in steps)
    return step


def _at_level(tuning: dict[str, Any]) -> dict[str, Any] | None:
    """The error-free readings at the parallelism the tuner chose (or the nearest level read below it), as
    one: their mean rate and cores (one fast re-reading elsewhere on the curve says nothing of the level
    collection runs at)."""
    chosen = tuning.get("chosen_parallelism")
    clean = [s for s in tuning.get("steps", []) if not s.get("errors")]
    level = max((s["parallelism"] for s in clean if chosen is not None and s["parallelism"] <= chosen),
                default=None)  # fmt: skip
    at = [s for s in clean if s["parallelism"] == level]
    if not at:
        return None
    step: dict[str, Any] = {"parallelism": level}
    for key in ("rollouts_per_s", "client_cores", "busy_cores"):
        values = [s[key] for s in at if s.get(key) is not None]
        if len(values) == len(at):
            step[key] = sum(values) / len(values)
    return step if "rollouts_per_s" in step else None


def _figures(c: Collectors) -> tuple[float | None, float | None]:
    return c.client_cores, c.idle_cores


def collect_spec(spec: RunSpec, collectors: Collectors) -> RunSpec:
    """The spec the collect stage runs: as given, or on a local Dask cluster of `collectors.count`
    worker processes."""
    if collectors.count <= 1 or spec.runner != "local":
        return spec
    # a cluster of this machine's own: never the address or cluster class set for --runner dask
    local = {"dask_address": None, "dask_cluster_class": None, "dask_cluster_kwargs": {},
             "dask_adapt_min": None, "dask_adapt_max": None}  # fmt: skip
    return spec.model_copy(update={"runner": "dask", "dask_workers": collectors.count, **local})
