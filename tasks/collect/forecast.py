"""The run's forecast before collecting: rollouts (with settling), wall time and backend time, from the
rates diagnosis and tuning measured; the report sets it against what happened.

Pure functions: the pipeline gathers the measured figures and prints the text.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from rollflow.tasks.collect.parts import chunk_part_rollouts
from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.collect.settle import PENDING, SETTLED, decide
from rollflow.tasks.storage.ledger import Ledger

PROBE_TASKS_READ = 2000  # enough probe tasks for the settled share; the parts past them are not read


@dataclass
class Measured:
    """What diagnosis and tuning measured, and what the run still has to do."""

    tasks: int  # tasks still to collect
    num_repeats: int
    settle_after: int | None = None
    until_learnable: int | None = None
    rollouts_per_s: float | None = None  # at the chosen parallelism
    backend_s_per_rollout: float | None = None  # a rollout's time at the backend (its latency)
    probe_tasks: int = 0  # tasks whose first settle_after rollouts the probes answered
    probe_settled: int = 0  # of them, those all correct or all wrong


def forecast(m: Measured) -> dict[str, Any]:
    """Rollouts, wall and backend seconds the run should take; None where nothing was measured.

    With settling, the settled share is the probes' own (their tasks' first rollouts decide as a chunk's
    would); without probes it is unknown and the rollouts are given as the range [tasks*M, tasks*K].
    --until-learnable limits the tasks to those needed for its target at the measured learnable share.
    """
    k, after = m.num_repeats, m.settle_after
    share = m.probe_settled / m.probe_tasks if after is not None and m.probe_tasks else None
    tasks = m.tasks
    if m.until_learnable is not None:
        learnable = 1.0 - share if share is not None else None
        if learnable:
            tasks = min(tasks, -(-m.until_learnable * 1.0 // learnable))
    tasks = int(tasks)
    unknown_stop = m.until_learnable is not None and share is None  # how far the input goes is not known
    if unknown_stop:  # the target's tasks first, learnable, K each; or the whole input, all settled
        whole = tasks * (after if after is not None else k)
        low, high, rollouts = min((m.until_learnable or 0) * k, whole), tasks * k, None
    elif after is None:
        low = high = rollouts = tasks * k
    elif share is None:
        low, high, rollouts = tasks * after, tasks * k, None
    else:
        rollouts = round(tasks * (after + (1.0 - share) * (k - after)))
        low = high = rollouts
    mid = rollouts if rollouts is not None else (low + high) / 2
    rate, per = m.rollouts_per_s, m.backend_s_per_rollout
    return {
        "measured": asdict(m),
        "tasks": tasks,
        "tasks_at_most": unknown_stop,
        "settled_share": None if share is None else round(share, 4),
        "rollouts": rollouts,
        "rollouts_range": [low, high],
        "rollouts_full": tasks * k,
        "wall_s": round(mid / rate, 1) if rate else None,
        "backend_s": round(mid * per, 1) if per is not None else None,
    }


NOTHING_LEFT = "forecast: nothing left to collect"


def _rollouts(f: dict[str, Any]) -> str:
    """The forecast's rollouts: one figure, or its range where settling leaves them unknown."""
    low, high = f["rollouts_range"]
    if f["rollouts"] is not None:
        return f"{f['rollouts']:,}"
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"


def _answered(f: dict[str, Any]) -> str:
    """Where the settled share was read: tasks whose first rollouts are answered (by tuning's probes, or
    by a run stopped before these chunks committed)."""
    m = f["measured"]
    return f"the {m['probe_tasks']:,} tasks whose first {m['settle_after']} rollouts are already answered"


def forecast_text(f: dict[str, Any]) -> str:
    """One line for the CLI, said before the first chunk starts."""
    if not f["tasks"]:
        return NOTHING_LEFT
    rollouts = _rollouts(f)
    up_to = "up to " if f.get("tasks_at_most") else ""
    parts = [f"forecast: {rollouts} rollouts for {up_to}{f['tasks']:,} tasks"]
    if f["settled_share"] is not None:
        parts.append(f"{f['settled_share']:.0%} settled among {_answered(f)} (full: {f['rollouts_full']:,})")
    wall = f"{f['wall_s']:,.0f} s" if f["wall_s"] is not None else "unknown (no rate measured)"
    parts.append(f"collect wall {wall}")
    if f["backend_s"] is not None:
        parts.append(f"backend {f['backend_s']:,.0f} s")
    return "; ".join(parts)


def against_actual(f: dict[str, Any], rollouts: int, wall_s: float, backend_s: float) -> dict[str, Any]:
    """The forecast beside what happened, with each figure's actual/forecast ratio."""

    def ratio(actual: float, guess: float | None) -> float | None:
        return round(actual / guess, 3) if guess else None

    low, high = f["rollouts_range"]
    return {
        **f,
        "actual": {"rollouts": rollouts, "wall_s": round(wall_s, 1), "backend_s": round(backend_s, 1)},
        "actual_over_forecast": {
            "rollouts": ratio(rollouts, f["rollouts"] if f["rollouts"] is not None else (low + high) / 2),
            "wall_s": ratio(wall_s, f["wall_s"]),
            "backend_s": ratio(backend_s, f["backend_s"]),
        },
    }


def forecast_markdown(f: dict[str, Any]) -> str:
    """report.md's `## Forecast` section: forecast and actual side by side."""
    actual = f.get("actual", {})
    if not f["tasks"]:
        return NOTHING_LEFT
    rollouts = _rollouts(f)
    rows = [
        ("rollouts", rollouts, actual.get("rollouts")),
        ("wall s (collect)", f["wall_s"], actual.get("wall_s")),
        ("backend s", f["backend_s"], actual.get("backend_s")),
    ]
    lines = ["## Forecast", "", "| figure | forecast | actual |", "|---|---:|---:|"]
    for name, guess, real in rows:
        lines.append(f"| {name} | {'-' if guess is None else guess} | {'-' if real is None else real} |")
    if f["settled_share"] is not None:
        lines += ["", f"Settled share forecast from {_answered(f)}: {f['settled_share']:.1%}."]
    return "\n".join([*lines, ""])


def tuned_rates(tuning: dict[str, Any] | None) -> tuple[float | None, float | None]:
    """(rollouts/s, backend seconds per rollout) at the parallelism tuning chose, when it ran."""
    if not tuning:
        return None, None
    rate = (tuning.get("evidence") or {}).get("rollouts_per_s")
    chosen = tuning.get("chosen_parallelism")
    at = [s for s in tuning.get("steps", []) if s.get("parallelism") == chosen and s.get("latency_p50_s")]
    latency = sum(s["latency_p50_s"] for s in at) / len(at) if at else tuning.get("base_latency_s")
    return rate, latency


def probe_settling(
    ledger: Ledger, chunks: Iterable[ChunkSpec], num_repeats: int, after: int, threshold: float
) -> tuple[int, int]:
    """(tasks whose first `after` rollouts the saved probes hold, of them settled), over pending chunks."""
    tasks = settled = 0
    for chunk in chunks:
        if tasks >= PROBE_TASKS_READ:
            break
        kept = chunk_part_rollouts(ledger, chunk, num_repeats).kept
        if not kept:
            continue
        decisions = decide({t for t, _ in kept}, kept, after, threshold)
        tasks += sum(1 for d in decisions.values() if d != PENDING)
        settled += sum(1 for d in decisions.values() if d == SETTLED)
    return tasks, settled
