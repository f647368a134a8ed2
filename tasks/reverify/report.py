"""The reverify report: what scored the rows, before against after, and what it cost."""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime
from typing import Any

import orjson

from rollflow.settings.reverify import ReverifySpec
from rollflow.tasks.collect.percentiles import shown, shown_share
from rollflow.tasks.collect.plan import rollflow_version
from rollflow.tasks.collect.settle import settling_markdown, settling_report
from rollflow.tasks.publish.rewards import pass_at_k_counted, rewards_markdown
from rollflow.tasks.publish.verifier_story import verifier_story
from rollflow.tasks.reverify.compare import FAILED, Comparison
from rollflow.tasks.storage import owned
from rollflow.tasks.storage.store import Store

SIDES = ("correct", "incorrect", FAILED)


def agreement_table(cells: dict[str, int]) -> dict[str, dict[str, int]]:
    """before side -> after side -> rollouts, every cell present (0 when none)."""
    table = {b: {a: 0 for a in SIDES[:2]} for b in SIDES}
    for cell, n in cells.items():
        before, after = cell.split(">")
        table[before][after] = n
    return table


def build_report(
    spec: ReverifySpec,
    summary: Comparison,
    *,
    source: dict[str, Any],
    published: bool,
    failures: Counter[str],
    metrics: dict[str, Any],
) -> dict[str, Any]:
    after = summary.after.as_dict() if summary.after is not None else None
    before = summary.before.as_dict() if summary.before is not None else None
    dataset = spec.data_url() if spec.format == "parquet" else spec.dataset_url()
    return {
        "kind": "reverify",
        "generated_at": datetime.now(UTC).isoformat(),
        "source": source,
        "output": spec.output,
        "dataset": dataset if published else None,
        "format": spec.format,
        "published": published,
        "failed_only": spec.failed_only,
        "verifier": verifier_story(spec.verify),
        "rows_expected": summary.rows_expected,
        "rows_written": summary.rows,
        "failed": summary.failed,
        "missing": summary.missing,
        "failures_by_kind": dict(sorted(failures.items())),
        "invalid": summary.invalid,
        "rescored": summary.rescored,
        "changed": summary.changed,
        "reward_mean": after["mean"] if after else None,
        "previous_reward_mean": before["mean"] if before else None,
        "before": before,
        "after": after,
        "agreement": agreement_table(summary.agreement),
        "top_tasks": [
            {"task_index": t, "before_mean": round(b, 6), "after_mean": round(a, 6), "delta": round(a - b, 6)}
            for _, t, b, a in summary.top
        ],
        "returned": summary.story.as_dict(),
        "rollflow_version": rollflow_version(),
        "complete": summary.complete,
        "problems": summary.problems[:50],
        "metrics": metrics,
        **_settling(summary, after),
    }


def _settling(summary: Comparison, after: dict[str, Any] | None) -> dict[str, Any]:
    """The source's settling, read from its rows (the rule, the tasks, the rollouts never asked), with
    the settled tasks this verifier splits."""
    settled = (after or {}).get("settled", {}).get("tasks")
    if not settled or summary.settle_after is None:
        return {}
    m, k = summary.settle_after, summary.max_k
    section = settling_report(m, k, None, settled, settled * max(0, k - m), summary.rows)
    section["settled_split"] = ((after or {}).get("settled_split") or {}).get("tasks", 0)
    return {"settling": section}


def _pct(n: int, total: int) -> str:
    return shown_share(n / total) if total else "-"


def _before_after(report: dict[str, Any]) -> list[str]:
    before, after = report["before"] or {}, report["after"] or {}

    def cell(d: dict[str, Any], key: str) -> str:
        if not d:
            return "-"
        if key in ("all_correct", "none_correct", "mixed"):
            share = d[key]["share"]
            return shown_share(share)
        value = d.get(key)
        return "-" if value is None else f"{value:.4f}"

    lines = ["| | before | after |", "|---|---:|---:|"]
    lines += [f"| {label} | {cell(before, k)} | {cell(after, k)} |" for k, label in (
        ("mean", "mean reward"), ("all_correct", "tasks all correct"), ("none_correct", "tasks none correct"),
        ("mixed", "tasks mixed"),
    )]  # fmt: skip
    for k in after.get("pass_at_k") or {}:
        b = (before.get("pass_at_k") or {}).get(k)
        lines.append(f"| pass@{k} | {'-' if b is None else f'{b:.4f}'} | {after['pass_at_k'][k]:.4f} |")
    if after.get("pass_at_k"):
        over = [pass_at_k_counted(d) if d else None for d in (before, after)]
        lines.append(
            "| pass@k over (tasks) | " + " | ".join("-" if n is None else f"{n:,}" for n in over) + " |"
        )
    return lines


def _before_note(report: dict[str, Any]) -> list[str]:
    """Before is counted over the rollouts rescored here: those whose checks failed now are in neither."""
    if not report["failed"]:
        return []
    return [
        "",
        f"Both columns are over the rollouts that have a reward after rescoring: the {report['failed']:,} "
        "whose checks failed now are left out of both, so before differs from the source's own figures.",
    ]


def render_markdown(report: dict[str, Any]) -> str:
    verifier = report["verifier"]
    lib = f" ({verifier['library']} {verifier['library_version']})" if verifier["library"] else ""
    status = "published" if report["published"] else "NOT published"
    total = report["rows_written"]
    lines = [
        "# rollflow reverify report",
        "",
        f"Dataset {status}: `{report['dataset'] or '-'}`  ",
        f"Source: `{report['source']['url']}` (sha256 {report['source']['sha256'][:16]}..., "
        f"{report['source']['rows']:,} rollouts)  ",
        f"Verifier: **{verifier['name']}**{lib}, correct at reward >= {verifier['correct_threshold']:g}",
        "",
        "| metric | value |",
        "|---|---|",
        f"| rollouts written | {total:,} |",
        f"| rescored | {report['rescored']:,} |",
        f"| rewards changed | {report['changed']:,} ({_pct(report['changed'], total)}) |",
        f"| failed | {report['failed']:,} {report['failures_by_kind'] or ''} |",
        f"| missing from the source | {report.get('missing', 0):,} |",
        f"| rows/s | {shown(report['metrics'].get('rows_per_s'))} |",
        f"| wall s | {shown(report['metrics'].get('wall_s'))} |",
        "",
        "## Before and after",
        "",
        *_before_after(report),
        *_before_note(report),
        "",
        "## Agreement (rollouts; rows: before, columns: after)",
        "",
        "| before \\ after | correct | incorrect |",
        "|---|---:|---:|",
    ]
    for side, row in report["agreement"].items():
        if side != FAILED or any(row.values()):
            lines.append(f"| {side} | {row['correct']:,} | {row['incorrect']:,} |")
    if report["top_tasks"]:
        lines += [
            "",
            "## Tasks that changed most",
            "",
            "| task | before | after | change |",
            "|---:|---:|---:|---:|",
        ]
        lines += [
            f"| {t['task_index']} | {t['before_mean']:.3f} | {t['after_mean']:.3f} | {t['delta']:+.3f} |"
            for t in report["top_tasks"]
        ]
    returned = report.get("returned") or {}
    if returned.get("tokens_out", {}).get("rollouts"):
        t = returned["tokens_out"]
        reasons = ", ".join(f"{k} {n:,}" for k, n in returned["finish_reasons"].items())
        lines += [
            "",
            f"Tokens out per rollout: mean {shown(t['mean'])}, p50 {shown(t['p50'])}, p95 {shown(t['p95'])}, "
            f"max {shown(t['max'])}, total {t['total']:,}. Finish reasons: {reasons or '-'} (truncation rate "
            f"{shown_share(returned['truncation_rate'])}).",
        ]
    if report.get("settling"):
        lines += ["", settling_markdown(report["settling"])]
    if report["after"]:
        lines += ["", rewards_markdown(report["after"])]
    if report["problems"]:
        lines += ["", "## Problems", ""] + [f"- {p}" for p in report["problems"]]
    return "\n".join(lines) + "\n"


def write_report(store: Store, report: dict[str, Any]) -> None:
    owned.add(store, owned.REPORT, [store.url("report.json"), store.url("report.md")])
    store.write_bytes("report.json", orjson.dumps(report, option=orjson.OPT_INDENT_2))
    store.write_bytes("report.md", render_markdown(report).encode())
