"""throughput.png and the report.md section of diagnosis and tuning (matplotlib, Agg: no display needed)."""

from __future__ import annotations

import base64
import io
from typing import Any


def throughput_png(tuning: dict[str, Any]) -> bytes:
    """Throughput and p95 latency against parallelism (two y axes), the knee and the choice marked."""
    steps = sorted(tuning["steps"], key=lambda s: s["parallelism"])
    xs = [s["parallelism"] for s in steps]
    rates = [s["rollouts_per_s"] for s in steps]
    p95 = [(s["latency_p95_s"] or 0.0) * 1000 for s in steps]
    import matplotlib  # imported here: a run without tuning never pays its ~0.7 s import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    try:
        ax.plot(xs, rates, "o-", color="tab:blue", label="rollouts/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("parallelism (requests in flight)")
        ax.set_ylabel("rollouts/s (steady)", color="tab:blue")
        ax.set_ylim(bottom=0)
        lat = ax.twinx()
        lat.plot(xs, p95, "s--", color="tab:red", label="p95 latency")
        lat.set_ylabel("p95 latency (ms)", color="tab:red")
        lat.set_ylim(bottom=0)
        ax.axvline(tuning["knee"], color="gray", linestyle=":", label=f"knee {tuning['knee']}")
        ax.axvline(
            tuning["chosen_parallelism"],
            color="tab:green",
            linewidth=2,
            label=f"chosen {tuning['chosen_parallelism']}",
        )
        handles = ax.get_legend_handles_labels()[0] + lat.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="lower right", fontsize=8)
        ax.set_title("rollflow tune-parallelism")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def steps_table(tuning: dict[str, Any]) -> list[dict[str, Any]]:
    """The tuning steps as rows for a Prefect table artifact or the CLI."""
    return [
        {
            "phase": s["phase"],
            "parallelism": s["parallelism"],
            "rollouts/s": round(s["rollouts_per_s"], 1),
            "p50 ms": None if s["latency_p50_s"] is None else round(s["latency_p50_s"] * 1000, 1),
            "p95 ms": None if s["latency_p95_s"] is None else round(s["latency_p95_s"] * 1000, 1),
            "errors": s["errors"],
            "rollouts": s["rollouts"],
            "note": s.get("note", ""),
        }
        for s in tuning["steps"]
    ]


def diagnosis_markdown(diagnosis: dict[str, Any]) -> str:
    return "\n".join(
        [
            "## Diagnosis",
            "",
            f"**{diagnosis['verdict']}**: {diagnosis['next_step']}",
            "",
            f"{diagnosis['reason']}",
            "",
        ]
    )


def probe_fate(tuning: dict[str, Any]) -> str:
    """After collection: adopted and discarded as counted; before it: where the probes wait."""
    if "discarded" not in tuning:
        return "each successful one is saved as a part for its chunk to adopt"
    return f"{tuning['adopted']:,} adopted by their chunks, {tuning['discarded']:,} discarded"


def tuning_markdown(tuning: dict[str, Any], image: str = "throughput.png") -> str:
    """Markdown: the verdict line, the steps table, the plot (`image`: a file name or a data: URI)."""
    lines = [
        "## Tuning",
        "",
        f"Knee **{tuning['knee']}**, chosen parallelism **{tuning['chosen_parallelism']}** "
        f"(stopped on {tuning['stop_reason']}; peak {tuning['peak_rollouts_per_s']:,.1f} rollouts/s). "
        f"Tuning took {tuning['probe_rollouts']:,} rollouts (plus {tuning.get('seed_rollouts', 0):,} from "
        f"the diagnosis); {probe_fate(tuning)}.",
        "",
        "| phase | parallelism | rollouts/s | p50 ms | p95 ms | errors | rollouts | note |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in steps_table(tuning):
        lines.append(
            f"| {row['phase']} | {row['parallelism']} | {row['rollouts/s']:,.1f} | "
            f"{_num(row['p50 ms'], ',.1f')} | {_num(row['p95 ms'], ',.1f')} | {row['errors']} | "
            f"{row['rollouts']} | {row['note']} |"
        )
    for note in tuning.get("notes") or ():
        lines.append(f"\n- {note}")
    lines += ["", f"![throughput and p95 latency against parallelism]({image})", ""]
    return "\n".join(lines)
