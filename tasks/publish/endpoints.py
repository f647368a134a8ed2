"""The report's `endpoints` table: rows from the pool (or summed over Dask workers' pools), and markdown."""

from __future__ import annotations

from typing import Any

from rollflow.tasks.backends.endpoints import EndpointPool
from rollflow.tasks.collect.chunk import ChunkOutcome
from rollflow.tasks.collect.percentiles import shown_share

ENDPOINT_COLUMNS = ("endpoint", "rollouts", "rollouts/s", "errors", "limit", "out s", "engine")
# What the columns hold, said under the table wherever it is shown (the CLI, report.md).
ENDPOINTS_LEGEND = (
    "engine: the engine's peak requests running/waiting/KV-cache use while the run sampled it (- without "
    "metrics); limit: requests in flight allowed at the end; out s: seconds out of rotation"
)


def engine_cell(engine: dict[str, Any] | None) -> str:
    """Engine peaks as `running/waiting/KV%`, or `-` when the endpoint serves no metrics."""
    if not engine:
        return "-"
    kv = engine.get("kv_cache_usage_max")
    kv_text = shown_share(kv)
    return f"{engine.get('running_max', '-')}/{engine.get('waiting_max', '-')}/{kv_text}"


def engine_counters(rows: list[dict[str, Any]]) -> list[str]:
    """Each endpoint's engine counters while the run sampled it: preemptions and the prefix cache's hit
    rate (what prefix affinity raises); none for an endpoint without them."""
    lines = []
    for row in rows:
        engine = row.get("engine") or {}
        said = []
        if engine.get("preemptions") is not None:
            said.append(f"{engine['preemptions']:,} preemptions")
        if engine.get("prefix_cache_hit_rate") is not None:
            said.append(f"prefix hits {100 * engine['prefix_cache_hit_rate']:.0f}% of prompt tokens")
        if said:
            lines.append(f"- {row['url']}: {', '.join(said)}")
    return lines


def endpoint_cells(row: dict[str, Any]) -> tuple[str, ...]:
    """One row's cells, the same in report.md and the CLI."""
    rate = row.get("rollouts_per_s")
    agents = row.get("agents") or []
    return (
        row["url"] + (f" ({', '.join(agents)})" if agents else ""),
        f"{row['rollouts']:,}",
        "-" if rate is None else f"{rate:,.1f}",
        f"{row['errors']:,}",
        f"{row['limit']:,}",
        f"{row['out_of_rotation_s']:,.1f}",
        engine_cell(row.get("engine")),
    )


def endpoints_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "## Endpoints",
        "",
        "| " + " | ".join(ENDPOINT_COLUMNS) + " |",
        "|---|" + "---:|" * (len(ENDPOINT_COLUMNS) - 2) + "---|",
    ]
    lines += ["| " + " | ".join(endpoint_cells(row)) + " |" for row in rows]
    lines += ["", ENDPOINTS_LEGEND[:1].upper() + ENDPOINTS_LEGEND[1:] + "."]
    counters = engine_counters(rows)
    if counters:
        lines += ["", "Engine counters while the run sampled them:", "", *counters]
    return "\n".join(lines)


AGENT_COLUMNS = ("agent", "rollouts", "failed", "reward mean")


def agent_cells(name: str, row: dict[str, Any]) -> tuple[str, ...]:
    """One agent's cells, the same in report.md, the card and the CLI."""
    mean = row.get("reward_mean")
    return (name, f"{row['rollouts']:,}", f"{row['failed']:,}", "-" if mean is None else f"{mean:.4f}")


def agents_markdown(agents: dict[str, dict[str, Any]]) -> str:
    """## Agents: a dataset that mixes agents, told agent by agent (rows, failures, reward)."""
    lines = ["## Agents", "", "| " + " | ".join(AGENT_COLUMNS) + " |", "|---|---:|---:|---:|"]
    lines += ["| " + " | ".join(agent_cells(name, row)) + " |" for name, row in agents.items()]
    return "\n".join(lines)


def merge_rows(parts: list[list[dict[str, Any]]], limits: dict[str, int], seconds: float) -> list[dict]:
    """Dask and Ray: each worker process's pool counts its own traffic; sum them; rate over the collection."""
    merged: dict[str, dict[str, Any]] = {
        url: {"url": url, "rollouts": 0, "errors": 0, "out_of_rotation_s": 0.0} for url in limits
    }
    for rows in parts:
        for row in rows:
            into = merged.setdefault(row["url"], {"url": row["url"], "rollouts": 0, "errors": 0})
            into["rollouts"] += row["rollouts"]
            into["errors"] += row["errors"]
            into["out_of_rotation_s"] = max(into.get("out_of_rotation_s", 0.0), row["out_of_rotation_s"])
    return [
        {
            **row,
            "rollouts_per_s": round(row["rollouts"] / seconds, 3) if seconds > 0 else None,
            "limit": limits.get(url, 0),
            "out_of_rotation_s": round(row["out_of_rotation_s"], 3),
            "engine": None,
        }
        for url, row in merged.items()
    ]


def endpoint_rows(
    pool: EndpointPool, outcomes: list[ChunkOutcome], remote: bool, seconds: float
) -> list[dict[str, Any]]:
    """The run's endpoint rows: this process's pool, or (Dask) the workers' pools summed, with the engine
    peaks this process sampled."""
    if not remote:
        return pool.rows()
    newest: dict[str, tuple[int, list[dict[str, Any]]]] = {}
    for o in outcomes:  # each worker's pool counts all its chunks: its newest rows hold them all
        worker = o.worker or {}
        key, seq = worker.get("worker", id(o)), worker.get("seq", 0)
        if key not in newest or newest[key][0] <= seq:
            newest[key] = (seq, o.endpoints)
    rows = merge_rows([rows for _, rows in newest.values()], pool.limits(), seconds)
    engines = {ep.url: ep.engine() for ep in pool.endpoints if ep.engine is not None}
    return [{**row, "engine": engines.get(row["url"])} for row in rows]
