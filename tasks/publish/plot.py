"""throughput.png and the report.md section of diagnosis and tuning (matplotlib, Agg: no display needed)."""

from __future__ import annotations

import base64
import io
from typing import Any


def throughput_png(tuning: dict[str, Any]) -> bytes:
    """Throughput and p95 latency against parallelism (two y axes), the knee and the choice marked."""
    if "endpoints" in tuning:
        return endpoints_png(tuning)
    xs, rates, p95 = _curve(tuning)
    fig, axes = new_figure((7, 4))
    ax = axes[0, 0]
    errs = [s.get("rollouts_per_s_err", 0.0) for s in sorted(tuning["steps"], key=_level)]
    ax.errorbar(xs, rates, yerr=errs, fmt="o-", color="tab:blue", capsize=3, label="rollouts/s ± error")
    _capacity_line(ax, tuning)
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
    return png_bytes(fig)


# Margins in inches around each panel: room for the tick labels and axis label (left, bottom; right with a
# second y axis) and the title (top). Fixed, as tight_layout measured every label first (~0.07 s a plot).
LEFT_IN, RIGHT_IN, TWIN_RIGHT_IN, BOTTOM_IN, TOP_IN = 0.85, 0.25, 0.85, 0.6, 0.35
DPI = 110  # every figure's resolution: a 7 x 4 in figure is 770 x 440 pixels


def png_bytes(fig: Any) -> bytes:
    """A finished figure (a column of panels, as new_figure makes) as PNG bytes, in the fixed margins."""
    width, height = fig.get_size_inches()
    rows = fig.axes[0].get_subplotspec().get_gridspec().nrows
    twin = len(fig.axes) > rows  # a panel with a second y axis (twinx) labels its right side
    panel_in = (height - rows * (BOTTOM_IN + TOP_IN)) / rows
    fig.subplots_adjust(
        left=LEFT_IN / width,
        right=1 - (TWIN_RIGHT_IN if twin else RIGHT_IN) / width,
        bottom=BOTTOM_IN / height,
        top=1 - TOP_IN / height,
        hspace=(BOTTOM_IN + TOP_IN) / panel_in,
    )
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def new_figure(figsize: tuple[float, float], rows: int = 1) -> tuple[Any, Any]:
    """A figure on Agg's canvas and its column of `rows` axes (a 2-D array), built without pyplot: nothing
    global to close, and matplotlib is imported only when a plot is drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=DPI)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, 1, squeeze=False)


def _level(step: dict[str, Any]) -> int:
    return int(step["parallelism"])


def _capacity_line(ax: Any, tuning: dict[str, Any]) -> None:
    """The engine's own capacity where it stated one (running at most, or its KV cache's sequences)."""
    engine = tuning.get("engine") or {}
    capacity = engine.get("kv_max_concurrency") or engine.get("running_max")
    levels = [int(s["parallelism"]) for s in tuning.get("steps") or ()]
    if capacity and levels and capacity <= 4 * max(levels):  # a stated capacity far off the curve: not drawn
        what = "KV capacity" if engine.get("kv_max_concurrency") else "most running"
        ax.axvline(capacity, color="tab:purple", linestyle="-.", label=f"engine {what} {capacity:g}")


def _curve(tuning: dict[str, Any]) -> tuple[list[int], list[float], list[float]]:
    steps = sorted(tuning["steps"], key=_level)
    p95 = [(s["latency_p95_s"] or 0.0) * 1000 for s in steps]
    return [s["parallelism"] for s in steps], [s["rollouts_per_s"] for s in steps], p95


def endpoints_png(tuning: dict[str, Any]) -> bytes:
    """Each endpoint's curve in its own colour: throughput solid, p95 latency dashed, its choice marked."""
    fig, axes = new_figure((7, 4))
    ax = axes[0, 0]
    lat = ax.twinx()
    for i, ep in enumerate(tuning["endpoints"]):
        color = f"C{i % 10}"
        xs, rates, p95 = _curve(ep)
        ax.plot(xs, rates, "o-", color=color, label=f"{ep['url']}: chosen {ep['chosen_parallelism']}")
        lat.plot(xs, p95, "s--", color=color, alpha=0.5)
        ax.axvline(ep["chosen_parallelism"], color=color, linewidth=2, alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("parallelism per endpoint (requests in flight)")
    ax.set_ylabel("rollouts/s (steady, solid)")
    lat.set_ylabel("p95 latency (ms, dashed)")
    ax.set_ylim(bottom=0)
    lat.set_ylim(bottom=0)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"rollflow tune-parallelism: {tuning['chosen_parallelism']} in all")
    return png_bytes(fig)


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def evidence_said(tuning: dict[str, Any]) -> str:
    """How sure the choice is, in words: its readings, their spread and their error; or that it was set by
    a rule between measured levels, not measured itself."""
    ev = tuning.get("evidence")
    if not ev:
        return ""
    if ev["readings"] == 0:
        near = ev.get("nearest_below")
        return "not measured at its level: set by the rule" + (f" from {near} below it" if near else "")
    rate = f"{ev['rollouts_per_s']:,.1f} ± {ev['err']:,.1f} rollouts/s"
    if ev["readings"] == 1:
        return f"{rate} from one reading (no second reading to compare)"
    spread = f"over {ev['readings']} readings from {ev['low']:,.1f} to {ev['high']:,.1f}"
    if ev.get("agree", True):
        return f"{rate} {spread}"
    return (
        f"{ev['rollouts_per_s']:,.1f} rollouts/s {spread}, each ± {ev['err']:,.1f} at most: they disagree "
        "beyond their errors, so the backend's rate moved while tuning and the choice is no surer than that"
    )


def tuning_parts(tuning: dict[str, Any]) -> list[tuple[str | None, dict[str, Any]]]:
    """(endpoint URL, its tuning) for each endpoint tuned; (None, tuning) for a one-endpoint run."""
    if "endpoints" not in tuning:
        return [(None, tuning)]
    return [(ep["url"], ep) for ep in tuning["endpoints"]]


def steps_table(tuning: dict[str, Any]) -> list[dict[str, Any]]:
    """The tuning steps as rows for a Prefect table artifact or the CLI (several endpoints: URL first)."""
    if "endpoints" in tuning:
        return [{"endpoint": url, **row} for url, ep in tuning_parts(tuning) for row in steps_table(ep)]
    return [
        {
            "phase": s["phase"],
            "parallelism": s["parallelism"],
            "rollouts/s": round(s["rollouts_per_s"], 1),
            "±": round(s.get("rollouts_per_s_err", 0.0), 1),
            "p50 ms": None if s["latency_p50_s"] is None else round(s["latency_p50_s"] * 1000, 1),
            "p95 ms": None if s["latency_p95_s"] is None else round(s["latency_p95_s"] * 1000, 1),
            "errors": s["errors"],
            "rollouts": s["rollouts"],
            "note": s.get("note", ""),
        }
        for s in tuning["steps"]
    ]


def diagnosis_markdown(diagnosis: dict[str, Any]) -> str:
    if "endpoints" in diagnosis:
        lines = ["## Diagnosis", ""]
        for d in diagnosis["endpoints"]:
            lines += [f"- `{d['url']}`: **{d['verdict']}**: {d['next_step']}", f"  {d['reason']}"]
        return "\n".join([*lines, ""])
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


def _steps_lines(tuning: dict[str, Any]) -> list[str]:
    lines = [
        "| phase | parallelism | rollouts/s | ± | p50 ms | p95 ms | errors | rollouts | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in steps_table(tuning):
        lines.append(
            f"| {row['phase']} | {row['parallelism']} | {row['rollouts/s']:,.1f} | {row['±']:,.1f} | "
            f"{_num(row['p50 ms'], ',.1f')} | {_num(row['p95 ms'], ',.1f')} | {row['errors']} | "
            f"{row['rollouts']} | {row['note']} |"
        )
    for note in tuning.get("notes") or ():
        lines.append(f"\n- {note}")
    return lines


def _cost(tuning: dict[str, Any]) -> str:
    return (
        f"Tuning took {tuning['probe_rollouts']:,} rollouts (plus {tuning.get('seed_rollouts', 0):,} from "
        f"the diagnosis); {probe_fate(tuning)}."
    )


def tuning_markdown(tuning: dict[str, Any], image: str = "throughput.png") -> str:
    """Markdown: the verdict line, the steps table, the plot (`image`: a file name or a data: URI)."""
    if "endpoints" in tuning:
        return endpoints_markdown(tuning, image)
    lines = [
        "## Tuning",
        "",
        f"Knee **{tuning['knee']}**, chosen parallelism **{tuning['chosen_parallelism']}** "
        f"(stopped on {tuning['stop_reason']}; peak {tuning['peak_rollouts_per_s']:,.1f} rollouts/s; "
        f"choice: {tuning.get('choice_rule') or 'best measured throughput'}). "
        + (f"At the chosen level: {evidence_said(tuning)}. " if tuning.get("evidence") else "")
        + _cost(tuning),
        "",
        *_steps_lines(tuning),
    ]
    lines += ["", f"![throughput and p95 latency against parallelism]({image})", ""]
    return "\n".join(lines)


def endpoints_markdown(tuning: dict[str, Any], image: str) -> str:
    """Several endpoints: a summary table with the sum, then each endpoint's steps table."""
    lines = [
        "## Tuning",
        "",
        f"{len(tuning['endpoints'])} endpoints tuned at once in {tuning['wall_s']:,.1f} s: chosen "
        f"parallelism **{tuning['chosen_parallelism']}** in all. " + _cost(tuning),
        "",
        "| endpoint | knee | chosen | peak rollouts/s | stopped on | probe rollouts | tuned s |",
        "|---|---:|---:|---:|---|---:|---|",
    ]
    for ep in tuning["endpoints"]:
        span = f"{ep['started_s']:.1f}-{ep['ended_s']:.1f}"
        lines.append(
            f"| {ep['url']} | {ep['knee']} | {ep['chosen_parallelism']} | {ep['peak_rollouts_per_s']:,.1f} | "
            f"{ep['stop_reason']} | {ep['total_probe_rollouts']:,} | {span} |"
        )
    for url in tuning.get("unreachable") or ():
        lines.append(
            f"| {url} | - | {tuning['limits'][url]} | - | unreachable at the start: not tuned | 0 | |"
        )
    lines.append(
        f"| **sum** | {tuning['knee']} | **{tuning['chosen_parallelism']}** | "
        f"{tuning['peak_rollouts_per_s']:,.1f} |  | {tuning['total_probe_rollouts']:,} | |"
    )
    for ep in tuning["endpoints"]:
        lines += ["", f"### {ep['url']}", "", *_steps_lines(ep)]
    lines += ["", f"![throughput and p95 latency against parallelism, per endpoint]({image})", ""]
    return "\n".join(lines)
