"""The run's story in report.json (`story`): what was sent, what scored it, where it came from and what
came back, from the audit's row counts (`tasks/publish/row_stats.py`); and the story told as the CLI's
`story:` line and report.md's section."""

from __future__ import annotations

from typing import Any

import orjson

from rollflow.settings import RunSpec, redact
from rollflow.tasks.collect.percentiles import shown, shown_share
from rollflow.tasks.publish.failure_kinds import failures_by_kind
from rollflow.tasks.publish.verifier_story import verifier_story
from rollflow.tasks.storage.ledger import Ledger, RunIdentity


def run_story(spec: RunSpec, identity: RunIdentity, summary: Any, ledger: Ledger) -> dict[str, Any]:
    """report.json's `story`: what was sent, what scored it, where it came from, what came back."""
    returned = summary.story.as_dict()
    kind = spec.backend.kind.value
    return {
        "sent": {
            "backend_kind": kind,
            "model": spec.backend.model,
            "endpoints": [redact.redact(u) for u in spec.backend.urls],
            "models_answered": returned.pop("models"),
            "overrides": redact.redact_value(spec.collection.overrides),
            "sampling_params": returned.pop("sampling_params"),
            "seed": spec.collection.seed,
            "num_repeats": spec.collection.num_repeats,
        },
        "scored_by": verifier_story(
            spec.verify, scored=kind != "agent" or spec.verify.verifier_for(kind) != "none"
        ),
        "origin": {
            "rollflow_version": identity.rollflow_version,
            "input": redact.redact(spec.input),
            "input_sha256": identity.input_fingerprint,
            "input_rows": identity.rows,
            "spec": redact.redact_value(spec.model_dump(mode="json")),
        },
        "returned": {**returned, "failures_by_kind": failures_by_kind(ledger, ledger.committed())},
    }


def story_line(story: dict[str, Any]) -> str:
    """One line for the CLI: what was sent, what scored it, what came back."""
    sent, scored, returned = story["sent"], story["scored_by"], story["returned"]
    models = ", ".join(sent["models_answered"]) or sent["model"] or "-"
    out = returned["tokens_out"]
    parts = [f"models {models}", f"seed {shown(sent['seed'], missing='not set')}"]
    if scored:
        lib = f" ({scored['library']} {scored['library_version']})" if scored["library"] else ""
        parts.append(f"verifier {scored['name']}{lib}")
    if out["rollouts"]:
        figures = f"mean {shown(out['mean'])}, p95 {shown(out['p95'])}, max {shown(out['max'])}"
        parts.append(f"tokens out {figures}")
    if returned["truncation_rate"] is not None:
        parts.append(f"truncated {shown_share(returned['truncation_rate'])}")
    return "story: " + "; ".join(parts)


def story_markdown(story: dict[str, Any]) -> str:
    """report.md's `## The run's story` section."""
    sent, scored, origin, returned = story["sent"], story["scored_by"], story["origin"], story["returned"]
    rows = [
        ("backend", f"{sent['backend_kind']} at {', '.join(sent['endpoints'])}"),
        ("models answering", ", ".join(f"{m} ({n:,})" for m, n in sent["models_answered"].items()) or "-"),
        ("overrides", f"`{orjson.dumps(sent['overrides']).decode()}`"),
        ("seed", shown(sent["seed"], missing="not set")),
        ("verifier", "-" if not scored else f"{scored['name']} {scored['library_version'] or ''}".strip()),
        ("correct threshold", "-" if not scored else f"{scored['correct_threshold']:g}"),
        ("rollflow", origin["rollflow_version"]),
        (
            "input",
            f"{origin['input']} (sha256 {origin['input_sha256'][:16]}..., {origin['input_rows']:,} rows)",
        ),
        (
            "truncation rate",
            shown_share(returned["truncation_rate"]),
        ),
        ("finish reasons", ", ".join(f"{k} {n:,}" for k, n in returned["finish_reasons"].items()) or "-"),
        ("failures by kind", ", ".join(f"{k} {n:,}" for k, n in returned["failures_by_kind"].items()) or "-"),
    ]
    lines = ["## The run's story", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    lines += ["", "| tokens per rollout | mean | p50 | p95 | max | total |", "|---|---:|---:|---:|---:|---:|"]
    for side in ("tokens_in", "tokens_out"):
        t = returned[side]
        cells = " | ".join(shown(t[k]) for k in ("mean", "p50", "p95", "max", "total"))
        lines.append(f"| {side[7:]} | {cells} |")
    for key, values in sent["sampling_params"].items():
        lines.append("")
        lines.append(f"{key}: " + ", ".join(f"`{v}` x{n:,}" for v, n in values.items()))
    return "\n".join(lines) + "\n"
