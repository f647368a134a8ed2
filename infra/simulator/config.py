"""The simulator's knobs, changeable live through POST /admin/config."""

from __future__ import annotations

from dataclasses import dataclass, field

FAULT_KINDS = ("429", "500", "503", "reset", "hang", "malformed")
DEFAULT_FAULT_KINDS = ("429", "500", "503", "reset", "malformed")


@dataclass
class SimConfig:
    slots: int = 64
    latency_ms: float = 50.0
    per_token_ms: float = 0.0
    contention: float = 0.0
    jitter: float = 0.0
    max_queue: int | None = None
    seed: int = 0
    correct_rate: float = 0.7
    fault_rate: float = 0.0
    fault_kinds: tuple[str, ...] = field(default=DEFAULT_FAULT_KINDS)
    retry_after_s: float = 1.0
    hang_s: float = 3600.0
    min_tokens: int = 16
    max_tokens: int = 256

    LIVE = (
        "slots",
        "latency_ms",
        "per_token_ms",
        "contention",
        "jitter",
        "max_queue",
        "fault_rate",
        "fault_kinds",
    )

    def update(self, changes: dict[str, object]) -> None:
        for key, value in changes.items():
            if key not in self.LIVE:
                raise ValueError(f"{key} cannot be changed live; changeable: {', '.join(self.LIVE)}")
            if key == "fault_kinds":
                value = parse_fault_kinds(value if isinstance(value, str) else ",".join(value))  # type: ignore[arg-type]
            setattr(self, key, value)


def parse_fault_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown}; choose from {', '.join(FAULT_KINDS)}")
    return kinds
