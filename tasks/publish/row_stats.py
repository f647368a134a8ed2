"""What came back, counted row by row while a chunk is audited: tokens in and out, finish reasons, models,
the sampling parameters each row was sent with. Counts only, so chunks merge in any order.

Token counts are kept as value -> rollouts (a reply's token count takes a few thousand distinct values at
most), so p50 and p95 are exact (nearest rank) without holding a value per rollout.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import orjson

MAX_DISTINCT = 20  # distinct values kept per sampling parameter; the rest are counted as "(other)"
OTHER = "(other)"
NOT_SAMPLING = frozenset({"input", "tools", "instructions", "metadata", "tool_choice", "text"})
TRUNCATING = frozenset({"length", "max_output_tokens", "max_tokens"})


def _count(value: Any) -> int | None:
    """A usage figure as a token count, or None: a bool, a float or a negative is no count."""
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
    """The nearest-rank percentile of value -> count, exact without a list of every value."""
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
    """One side's tokens per rollout (mean, p50, p95, max, total) from its value -> rollouts counts."""
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
    """One chunk's (or the merged run's) counts of what came back; `state` crosses processes as JSON."""

    rows: int = 0
    tokens_in: Counter[int] = field(default_factory=Counter)
    tokens_out: Counter[int] = field(default_factory=Counter)
    finish: Counter[str] = field(default_factory=Counter)
    models: Counter[str] = field(default_factory=Counter)
    params: dict[str, Counter[str]] = field(default_factory=dict)

    def add(self, row: dict[str, Any]) -> None:
        """One output row counted: its usage, finish reason, model and the sampling parameters it was sent."""
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

    def _param(self, key: str, value: str, n: int = 1) -> None:
        """Counts a parameter's value; past MAX_DISTINCT values a new one counts as OTHER (bounded state)."""
        seen = self.params.setdefault(key, Counter())
        if value in seen or len(seen) < MAX_DISTINCT:
            seen[value] += n
        else:
            seen[OTHER] += n

    def merge(self, other: RowStory) -> None:
        """Adds another chunk's counts: the order chunks merge in changes nothing but OTHER's share."""
        self.rows += other.rows
        self.tokens_in.update(other.tokens_in)
        self.tokens_out.update(other.tokens_out)
        self.finish.update(other.finish)
        self.models.update(other.models)
        for key, values in other.params.items():
            for value, n in values.items():
                self._param(key, value, n)

    def state(self) -> dict[str, Any]:
        """The counts as JSON (keys as strings), kept in the chunk's audit and merged later."""
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
        """The counts `state` wrote, token values back to ints."""
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
