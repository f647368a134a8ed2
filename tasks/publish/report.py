"""The run report: report.json for machines, report.md for people; both written whole."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from rollflow.tasks.collect.forecast import forecast_markdown
from rollflow.tasks.collect.settle import settling_markdown
from rollflow.tasks.publish.audit import AuditSummary, agent_rows
from rollflow.tasks.publish.control_plot import CONTROL_PNG, control_markdown, control_png
from rollflow.tasks.publish.endpoints import agents_markdown, endpoints_markdown
from rollflow.tasks.publish.plot import data_uri, diagnosis_markdown, throughput_png, tuning_markdown
from rollflow.tasks.publish.rewards import rewards_markdown, rewards_png
from rollflow.tasks.publish.story import story_markdown
from rollflow.tasks.storage import owned
from rollflow.tasks.storage.store import Store

REWARDS_PNG, THROUGHPUT_PNG = "rewards.png", "throughput.png"


@dataclass
class RunMetrics:
    """What this invocation did (resumed chunks are counted, not timed).

    Each rollout its chunks committed is in one of `collected` (requested by this run's chunk attempts,
    saved parts of a stalled or killed attempt included), `adopted` (saved by tuning's probes, this
    command's or an earlier one's) and `resumed` (already in a partly failed commit of the chunk).
    """

    wall_s: float
    collect_s: float
    collected: int
    output_tokens: int
    retries: int
    parallelism: int  # as configured or tuned: the endpoints' limits summed
    peak_in_flight: int
    chunks_run: int
    chunks_skipped: int
    latency_p50_s: float | None = None
    latency_p95_s: float | None = None
    backend_s: float = 0.0
    verify_s: float = 0.0
    collect_cpu_s: float = 0.0
    peak_rss_mb: float = 0.0
    prefect_overhead_share: float | None = None
    stages: dict[str, float] = field(default_factory=dict)
    adopted: int = 0
    resumed: int = 0
    limit_at_end: int | None = None  # the shared limit as the run ended (lower while a replica is out)


def probe_accounting(tuning: dict[str, Any], adopted: int) -> dict[str, Any]:
    """Probe rollouts requested minus those chunks adopted at commit: what tuning cost the dataset.

    `adopted` counts this command's own probe rollouts (its session's parts) that its chunks committed,
    so neither an earlier command's probes nor a chunk's own saved rollouts inflate it; a failed probe is
    never saved, and a part no chunk committed is not adopted, so either shows as discarded.
    """
    requested = tuning["total_probe_rollouts"]
    return {**tuning, "adopted": adopted, "discarded": requested - adopted}


def build_report(
    *,
    input_url: str,
    output_url: str,
    dataset_url: str,
    backend_kind: str,
    summary: AuditSummary,
    metrics: RunMetrics,
    published: bool,
    bad_rows: int,
    extra: dict[str, Any] | None = None,
    adopted: int = 0,
) -> dict[str, Any]:
    collect_s = metrics.collect_s or 0.0
    tuning = probe_accounting(extra["tuning"], adopted) if extra and extra.get("tuning") else None
    produced = metrics.collected + metrics.adopted
    report: dict[str, Any] = {
        "generated_at": datetime.now(UTC).isoformat(),
        "input": input_url,
        "output": output_url,
        "dataset": dataset_url if published else None,
        "published": published,
        "backend_kind": backend_kind,
        "rows_expected": summary.rows_expected,
        "rows_written": summary.rows_written,
        "failed": summary.failed,
        "duplicates": summary.duplicates,
        "missing": summary.missing,
        "missing_chunks": summary.uncommitted_chunks,
        "invalid": summary.invalid,
        "missing_reward": summary.missing_reward,
        "bad_input_rows": bad_rows,
        **reward_figures(summary),
        **whole_run_rates(metrics, produced, summary),
        "collect_rollouts_per_s": round(metrics.collected / collect_s, 3) if collect_s > 0 else None,
        "wall_s": round(metrics.wall_s, 3),
        "stages": metrics.stages,
        "parallelism": metrics.parallelism,
        "limit_at_end": metrics.limit_at_end,
        "agents": agent_rows(summary.agents),
        "audit_ok": summary.ok,
        "audit_problems": summary.problems[:50],
        "metrics": asdict(metrics),
    }
    if extra:
        report.update(extra)
    if tuning:
        report["tuning"] = tuning
    return report


def reward_figures(summary: AuditSummary) -> dict[str, Any]:
    """`reward_mean` is the statistics' own mean (each (task, rollout) once), so the two never differ."""
    rewards = summary.rewards.as_dict() if summary.rewards is not None else None
    return {"reward_mean": rewards["mean"] if rewards else None, "rewards": rewards}


def whole_run_rates(metrics: RunMetrics, produced: int, summary: AuditSummary) -> dict[str, float | None]:
    """Rollouts this command added to the dataset (collected or adopted probes) over its whole wall time.

    Output tokens are the dataset's tokens per rollout times those rollouts: exact when this command
    produced the whole dataset, the dataset's average when it resumed earlier chunks.
    """
    wall = metrics.wall_s
    if wall <= 0:
        return {"rollouts_per_s": None, "output_tokens_per_s": None}
    per_row = summary.output_tokens / summary.rows_written if summary.rows_written else 0.0
    return {
        "rollouts_per_s": round(produced / wall, 3),
        "output_tokens_per_s": round(produced * per_row / wall, 3),
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


SUMMARY_KEYS = (
    "rows_expected",
    "rows_written",
    "failed",
    "duplicates",
    "missing",
    "reward_mean",
    "rollouts_per_s",
    "output_tokens_per_s",
    "collect_rollouts_per_s",
    "wall_s",
    "parallelism",
)


def render_markdown(report: dict[str, Any], images: dict[str, str] | None = None) -> str:
    """report.md; `images` maps rewards.png and throughput.png to what to show (data: URIs in the
    Prefect artifact, which cannot reach the files), else the file names beside report.md."""
    images = images or {}
    status = "published" if report["published"] else "NOT published"
    lines = [
        "# rollflow run report",
        "",
        f"Dataset {status}: `{report['dataset'] or '-'}`  ",
        f"Input: `{report['input']}`  ",
        f"Output: `{report['output']}`  ",
        f"Backend: {report['backend_kind']}",
        "",
        "| metric | value |",
        "|---|---|",
    ]
    lines += [f"| {key} | {_fmt(report.get(key))} |" for key in SUMMARY_KEYS]
    if report.get("stages"):
        lines += ["", "| stage | seconds |", "|---|---|"]
        lines += [f"| {name} | {_fmt(float(s))} |" for name, s in report["stages"].items()]
    if report.get("collectors"):
        lines += ["", _collectors_line(report)]
    if report.get("settling"):
        lines += ["", settling_markdown(report["settling"])]
    if report.get("until_learnable"):
        lines += ["", "## Until learnable", "", report["until_learnable"]["reason"] + ".", ""]
    if report.get("forecast"):
        lines += ["", forecast_markdown(report["forecast"])]
    if report.get("rewards"):
        lines += ["", rewards_markdown(report["rewards"], image=images.get(REWARDS_PNG, REWARDS_PNG))]
    if report.get("story"):
        lines += ["", story_markdown(report["story"])]
    if report.get("agents"):
        lines += ["", agents_markdown(report["agents"])]
    if report.get("endpoints"):
        lines += ["", endpoints_markdown(report["endpoints"])]
    if report.get("diagnosis"):
        lines += ["", diagnosis_markdown(report["diagnosis"])]
    if report.get("tuning"):
        lines += ["", tuning_markdown(report["tuning"], image=images.get(THROUGHPUT_PNG, THROUGHPUT_PNG))]
    if _controlled(report):
        lines += ["", control_markdown(report["adaptive"], image=images.get(CONTROL_PNG, CONTROL_PNG))]
    if report.get("missing_chunks"):
        chunks = ", ".join(map(str, report["missing_chunks"][:50]))
        lines += ["", f"Chunks not committed ({report['missing']:,} rollouts missing): {chunks}"]
    if report.get("publish_error"):
        lines += ["", "## Not published", "", report["publish_error"]]
    if report.get("audit_problems"):
        lines += ["", "## Audit problems", ""] + [f"- {p}" for p in report["audit_problems"]]
    return "\n".join(lines) + "\n"


def _collectors_line(report: dict[str, Any]) -> str:
    """How many processes collected and why; with more than one, the cluster they ran as."""
    c = report["collectors"]
    line = f"Collector processes: {c['count']} ({c['why']})"
    if c["count"] > 1 and report.get("runner"):
        ran = len(report.get("workers") or [])
        line += f", as a local {report['runner'].capitalize()} cluster; {ran} of them collected chunks"
    return line + "."


def write_report(store: Store, report: dict[str, Any]) -> None:
    """report.json, report.md and rewards.png (throughput.png is written by tuning, when it ran)."""
    names = ["report.json", "report.md", *([REWARDS_PNG] if report.get("rewards") else [])]
    names += [CONTROL_PNG] if _controlled(report) else []
    owned.add(store, owned.REPORT, [store.url(n) for n in names])
    if report.get("rewards"):
        store.write_bytes(REWARDS_PNG, rewards_png(report["rewards"]))
    if _controlled(report):
        store.write_bytes(CONTROL_PNG, control_png(report["adaptive"]))
    store.write_bytes("report.json", orjson.dumps(report, option=orjson.OPT_INDENT_2))
    store.write_bytes("report.md", render_markdown(report).encode())


def _controlled(report: dict[str, Any]) -> bool:
    """The limit followed the run (adaptive or engine control) and has decisions to show."""
    return bool((report.get("adaptive") or {}).get("history"))


def write_throughput_png(store: Store, tuning: dict[str, Any]) -> bytes:
    """throughput.png in the output, recorded as the report's; returns the plot."""
    png = throughput_png(tuning)
    owned.add(store, owned.REPORT, [store.url(THROUGHPUT_PNG)])
    store.write_bytes(THROUGHPUT_PNG, png)
    return png


def embedded_images(store: Store, report: dict[str, Any]) -> dict[str, str]:
    """The plots report.md refers to, as data: URIs read back from the output (for a Prefect artifact,
    which shows no file beside it)."""
    names = [REWARDS_PNG] if report.get("rewards") else []
    names += [THROUGHPUT_PNG] if report.get("tuning") else []
    names += [CONTROL_PNG] if _controlled(report) else []
    found = store.read_many(names)
    return {name: data_uri(png) for name, png in found.items()}
