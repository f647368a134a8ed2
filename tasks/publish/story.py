"""What came back, counted row by row while a chunk is audited: tokens in and out, finish reasons, models,
the sampling parameters each row was sent with. Counts only, so chunks merge in any order.

Token counts are kept as value -> rollouts (a reply's token count takes a few thousand distinct values at
most), so p50 and p95 are exact (nearest rank) without holding a value per rollout.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import orjson

from rollflow.settings import RunSpec, VerifySettings, redact
from rollflow.tasks.storage import rowjson
from rollflow.tasks.storage.ledger import ChunkManifest, Ledger, RunIdentity

MAX_DISTINCT = 20  # distinct values kept per sampling parameter; the rest are counted as "(other)"
OTHER = "(other)"
NOT_SAMPLING = frozenset({"input", "tools", "instructions", "metadata", "tool_choice", "text"})
TRUNCATING = frozenset({"length", "max_output_tokens", "max_tokens"})
LIBRARIES = {"math": "math-verify"}


def _count(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def finish_reason(response: dict[str, Any]) -> str:
    """stop, length, content_filter, refusal, ...: Responses' status and incomplete_details, or the chat
    reply's finish_reason; a message that refused says `refusal`."""
    status = response.get("status")
    if status == "incomplete":
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        return str(reason or "incomplete")
    for item in response.get("output") or ():
        content = item.get("content") if isinstance(item, dict) and item.get("type") == "message" else None
        if any(isinstance(c, dict) and c.get("type") == "refusal" for c in content or ()):
            return "refusal"
    reason = response.get("finish_reason")
    if reason:
        return str(reason)
    return "stop" if status in (None, "completed") else str(status)


def _percentile(counts: dict[int, int], share: float) -> int | None:
    total = sum(counts.values())
    if not total:
        return None
    rank, seen = max(1, -(-total * share // 1)), 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= rank:
            return value
    return None


def token_figures(counts: dict[int, int]) -> dict[str, Any]:
    n = sum(counts.values())
    total = sum(v * c for v, c in counts.items())
    return {
        "rollouts": n,
        "mean": round(total / n, 3) if n else None,
        "p50": _percentile(counts, 0.5),
        "p95": _percentile(counts, 0.95),
        "max": max(counts) if counts else None,
        "total": total,
    }


@dataclass
class RowStory:
    rows: int = 0
    tokens_in: Counter[int] = field(default_factory=Counter)
    tokens_out: Counter[int] = field(default_factory=Counter)
    finish: Counter[str] = field(default_factory=Counter)
    models: Counter[str] = field(default_factory=Counter)
    params: dict[str, Counter[str]] = field(default_factory=dict)

    def add(self, row: dict[str, Any]) -> None:
        self.rows += 1
        response = row.get("response")
        if isinstance(response, dict):
            usage = response.get("usage")
            if isinstance(usage, dict):
                t_in = _count(usage.get("input_tokens", usage.get("prompt_tokens")))
                t_out = _count(usage.get("output_tokens", usage.get("completion_tokens")))
                if t_in is not None:
                    self.tokens_in[t_in] += 1
                if t_out is not None:
                    self.tokens_out[t_out] += 1
            self.finish[finish_reason(response)] += 1
            if response.get("model"):
                self.models[str(response["model"])] += 1
        params = row.get("responses_create_params")
        if isinstance(params, dict):
            for key, value in params.items():
                if key not in NOT_SAMPLING:
                    self._param(key, orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode())

    def _param(self, key: str, value: str) -> None:
        seen = self.params.setdefault(key, Counter())
        if value in seen or len(seen) < MAX_DISTINCT:
            seen[value] += 1
        else:
            seen[OTHER] += 1

    def merge(self, other: RowStory) -> None:
        self.rows += other.rows
        self.tokens_in.update(other.tokens_in)
        self.tokens_out.update(other.tokens_out)
        self.finish.update(other.finish)
        self.models.update(other.models)
        for key, values in other.params.items():
            for value, n in values.items():
                seen = self.params.setdefault(key, Counter())
                if value in seen or len(seen) < MAX_DISTINCT:
                    seen[value] += n
                else:
                    seen[OTHER] += n

    def state(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "tokens_in": {str(k): v for k, v in self.tokens_in.items()},
            "tokens_out": {str(k): v for k, v in self.tokens_out.items()},
            "finish": dict(self.finish),
            "models": dict(self.models),
            "params": {k: dict(v) for k, v in self.params.items()},
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RowStory:
        return cls(
            rows=state["rows"],
            tokens_in=Counter({int(k): v for k, v in state["tokens_in"].items()}),
            tokens_out=Counter({int(k): v for k, v in state["tokens_out"].items()}),
            finish=Counter(state["finish"]),
            models=Counter(state["models"]),
            params={k: Counter(v) for k, v in state["params"].items()},
        )

    def as_dict(self) -> dict[str, Any]:
        """The report's `returned` figures: tokens per rollout, finish reasons, models, parameters sent."""
        answered = sum(self.finish.values())
        truncated = sum(n for reason, n in self.finish.items() if reason in TRUNCATING)
        return {
            "rollouts": self.rows,
            "tokens_in": token_figures(self.tokens_in),
            "tokens_out": token_figures(self.tokens_out),
            "finish_reasons": dict(self.finish.most_common()),
            "truncated": truncated,
            "truncation_rate": round(truncated / answered, 6) if answered else None,
            "models": dict(self.models.most_common()),
            "sampling_params": {
                key: dict(values.most_common()) for key, values in sorted(self.params.items())
            },
        }


def verifier_story(verify: VerifySettings, scored: bool = True) -> dict[str, Any] | None:
    """The verifier, its library's version (math-verify's for `math`) and the settings it ran with; None
    when the backend gave the rewards (an agent)."""
    if not scored:
        return None
    name = verify.verifier_for("responses")  # an agent's replies are scored only by a verifier set
    library = LIBRARIES.get(name)
    try:
        library_version = version(library) if library else None
    except PackageNotFoundError:
        library_version = None
    return {
        "name": name,
        "url": scrub_url(verify.url) if name == "http" and verify.url else None,
        "library": library,
        "library_version": library_version,
        "correct_threshold": verify.correct_threshold,
        "check_timeout_s": verify.check_timeout_s,
        "processes": verify.processes,
    }


def scrub_url(url: str) -> str:
    """A URL without user:password@ and with every registered secret masked."""
    return redact.redact(url)


def scrubbed(value: Any) -> Any:
    """Any JSON-ready value with URLs' credentials and registered secrets masked in its strings (never
    in its rendered text: a short key such as `1` or `null` would change numbers or break the JSON)."""
    return redact.redact_value(value)


def failures_by_kind(ledger: Ledger, manifests: dict[int, ChunkManifest]) -> dict[str, int]:
    kinds: Counter[str] = Counter()
    for index, manifest in manifests.items():
        if manifest.failed:
            for line in ledger.store.read_bytes(ledger.failures_path(index)).splitlines():
                if line.strip():
                    kinds[rowjson.failure_kind(line)] += 1
    return dict(kinds.most_common())


def run_story(spec: RunSpec, identity: RunIdentity, summary: Any, ledger: Ledger) -> dict[str, Any]:
    """report.json's `story`: what was sent, what scored it, where it came from, what came back."""
    returned = summary.story.as_dict()
    kind = spec.backend.kind.value
    return {
        "sent": {
            "backend_kind": kind,
            "model": spec.backend.model,
            "endpoints": [scrub_url(u) for u in spec.backend.urls],
            "models_answered": returned.pop("models"),
            "overrides": scrubbed(spec.collection.overrides),
            "sampling_params": returned.pop("sampling_params"),
            "seed": spec.collection.seed,
            "num_repeats": spec.collection.num_repeats,
        },
        "scored_by": verifier_story(
            spec.verify, scored=kind != "agent" or spec.verify.verifier_for(kind) != "none"
        ),
        "origin": {
            "rollflow_version": identity.rollflow_version,
            "input": scrub_url(spec.input),
            "input_sha256": identity.input_fingerprint,
            "input_rows": identity.rows,
            "spec": scrubbed(spec.model_dump(mode="json")),
        },
        "returned": {**returned, "failures_by_kind": failures_by_kind(ledger, ledger.committed())},
    }


def story_line(story: dict[str, Any]) -> str:
    """One line for the CLI: what was sent, what scored it, what came back."""
    sent, scored, returned = story["sent"], story["scored_by"], story["returned"]
    models = ", ".join(sent["models_answered"]) or sent["model"] or "-"
    out = returned["tokens_out"]
    parts = [f"models {models}", f"seed {sent['seed']}"]
    if scored:
        lib = f" ({scored['library']} {scored['library_version']})" if scored["library"] else ""
        parts.append(f"verifier {scored['name']}{lib}")
    if out["rollouts"]:
        parts.append(f"tokens out mean {out['mean']:g}, p95 {out['p95']}, max {out['max']}")
    if returned["truncation_rate"] is not None:
        parts.append(f"truncated {returned['truncation_rate']:.1%}")
    return "story: " + "; ".join(parts)


def story_markdown(story: dict[str, Any]) -> str:
    """report.md's `## The run's story` section."""
    sent, scored, origin, returned = story["sent"], story["scored_by"], story["origin"], story["returned"]
    rows = [
        ("backend", f"{sent['backend_kind']} at {', '.join(sent['endpoints'])}"),
        ("models answering", ", ".join(f"{m} ({n:,})" for m, n in sent["models_answered"].items()) or "-"),
        ("overrides", f"`{orjson.dumps(sent['overrides']).decode()}`"),
        ("seed", str(sent["seed"])),
        ("verifier", "-" if not scored else f"{scored['name']} {scored['library_version'] or ''}".strip()),
        ("correct threshold", "-" if not scored else f"{scored['correct_threshold']:g}"),
        ("rollflow", origin["rollflow_version"]),
        (
            "input",
            f"{origin['input']} (sha256 {origin['input_sha256'][:16]}..., {origin['input_rows']:,} rows)",
        ),
        (
            "truncation rate",
            "-" if returned["truncation_rate"] is None else f"{returned['truncation_rate']:.2%}",
        ),
        ("finish reasons", ", ".join(f"{k} {n:,}" for k, n in returned["finish_reasons"].items()) or "-"),
        ("failures by kind", ", ".join(f"{k} {n:,}" for k, n in returned["failures_by_kind"].items()) or "-"),
    ]
    lines = ["## The run's story", "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]
    lines += ["", "| tokens per rollout | mean | p50 | p95 | max | total |", "|---|---:|---:|---:|---:|---:|"]
    for side in ("tokens_in", "tokens_out"):
        t = returned[side]
        lines.append(f"| {side[7:]} | {t['mean']} | {t['p50']} | {t['p95']} | {t['max']} | {t['total']:,} |")
    for key, values in sent["sampling_params"].items():
        lines.append("")
        lines.append(f"{key}: " + ", ".join(f"`{v}` x{n:,}" for v, n in values.items()))
    return "\n".join(lines) + "\n"
