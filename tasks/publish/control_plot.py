"""control.png and report.md's section on how the limit moved: the limit over time against the engine's
signals, so a user can see why it moved."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from rollflow.tasks.publish.plot import new_figure, png_bytes

CONTROL_PNG = "control.png"


def control_png(adaptive: dict[str, Any]) -> bytes:
    """Per endpoint: the limit and the engine's running and waiting requests over time (left axis), its
    KV cache's use (right axis) and each interval with preemptions marked."""
    endpoints = adaptive.get("endpoints") or [{"url": "", "history": adaptive["history"]}]
    fig, axes = new_figure((7, 3.2 * len(endpoints)), rows=len(endpoints))
    for ax, ep in zip(axes[:, 0], endpoints, strict=True):
        _panel(ax, ep["history"], ep["url"])
    return png_bytes(fig)


def _panel(ax: Any, history: list[dict[str, Any]], url: str) -> None:
    ts = [h["t_s"] for h in history]
    ax.step(ts, [h["limit"] for h in history], where="post", color="tab:green", linewidth=2, label="limit")
    for key, color in (("running", "tab:blue"), ("waiting", "tab:orange")):
        points = [(h["t_s"], h[key]) for h in history if h.get(key) is not None]
        if points:
            ax.plot(*zip(*points, strict=True), color=color, linewidth=1, label=key)
    hits = [h["t_s"] for h in history if h.get("preempted")]
    if hits:
        ax.plot(hits, [0] * len(hits), "rx", label="preemptions")
    ax.set_xlabel("seconds")
    ax.set_ylabel("requests")
    ax.set_ylim(bottom=0)
    kv = [(h["t_s"], h["kv_cache_usage"]) for h in history if h.get("kv_cache_usage") is not None]
    handles = ax.get_legend_handles_labels()[0]
    if kv:
        right = ax.twinx()
        right.plot(*zip(*kv, strict=True), color="tab:purple", linestyle="--", label="KV cache used")
        right.set_ylim(0, 1.05)
        right.set_ylabel("KV cache used", color="tab:purple")
        handles += right.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="lower right", fontsize=7)
    ax.set_title(f"rollflow concurrency control {url}".strip(), fontsize=9)


def _moves(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The decisions that moved the limit (and the first, where it started)."""
    return [h for i, h in enumerate(history) if i == 0 or h["limit"] != history[i - 1]["limit"]]


def control_markdown(adaptive: dict[str, Any], image: str = CONTROL_PNG) -> str:
    """Where each limit started and why, its moves with their reasons, and the plot."""
    lines = ["## Concurrency control", ""]
    for url, why in (adaptive.get("started") or {}).items():
        lines.append(f"- {url} started at {why}")
    lines.append(f"- final parallelism: {adaptive['final_parallelism']}")
    histories = [(ep["url"], ep["history"]) for ep in adaptive.get("endpoints") or []]
    histories = histories or [("", adaptive["history"])]
    moves = sorted(
        ((h["t_s"], url, h) for url, history in histories for h in _moves(history)), key=lambda m: m[0]
    )
    lines += ["", "| t (s) | endpoint | limit | why |", "|---|---|---|---|"]
    for t_s, url, h in moves[:60]:
        lines.append(f"| {t_s:.1f} | {url} | {h['limit']} | {h['why']} |")
    if len(moves) > 60:
        lines.append(f"| | | | {len(moves) - 60} more moves in report.json's adaptive history |")
    history = [h for _, hist in histories for h in hist]
    held = Counter(re.sub(r"\d+(\.\d+)?", "N", h["why"]) for h in history)
    lines += [
        "",
        "Reasons over all intervals: " + ", ".join(f"{why} ({n})" for why, n in held.most_common(8)),
    ]
    return "\n".join([*lines, "", f"![concurrency control]({image})"])
