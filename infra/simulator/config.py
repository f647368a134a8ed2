"""The simulator's knobs as one dataclass, shared by the CLI, the in-process starter and /admin/config."""

from __future__ import annotations

from dataclasses import dataclass, field

FAULT_KINDS = ("429", "500", "503", "reset", "hang", "malformed", "error_object", "null_reward")
DEFAULT_FAULT_KINDS = ("429", "500", "503", "reset", "malformed")
METRICS_FORMATS = ("vllm", "sglang", "none", "garbage")
MODELS = ("slots", "batching")
DIFFICULTIES = ("flat", "spread")


@dataclass
class SimConfig:
    """Capacity, content and fault settings; the fields in LIVE may change while serving.

    `model` picks the capacity model: "slots" (capacity.py: fixed slots, a sharp knee) uses slots,
    latency_ms, per_token_ms and contention; "batching" (batching.py: a continuous-batching engine, a
    gradual curve) uses step_ms, seq_step_ms, max_num_seqs, kv_tokens or kv_blocks and block_size,
    kv_prompt_tokens, prefill_tokens, preempt_after and recompute.
    """

    model: str = "slots"
    slots: int = 64
    latency_ms: float = 50.0
    per_token_ms: float = 0.0
    contention: float = 0.0
    jitter: float = 0.0
    max_queue: int | None = None
    seed: int = 0
    correct_rate: float = 0.7
    # "flat": every prompt is correct at correct_rate; "spread": a per-prompt difficulty (content.py
    # task_rate): settled_share of prompts always or never solved, the rest at a rate in [0.2, 0.8]
    difficulty: str = "flat"
    settled_share: float = 0.6
    fault_rate: float = 0.0
    fault_kinds: tuple[str, ...] = field(default=DEFAULT_FAULT_KINDS)
    retry_after_s: float = 1.0
    hang_s: float = 3600.0
    min_tokens: int = 16
    max_tokens: int = 256
    metrics_format: str = "vllm"
    step_ms: float = 1.0
    seq_step_ms: float = 0.08
    max_num_seqs: int = 256
    kv_tokens: int | None = None
    kv_blocks: int | None = None
    block_size: int = 16
    kv_prompt_tokens: int = 64
    prefill_tokens: int = 0
    prefix_cache_prompts: int = 256
    preempt_after: int | None = None
    recompute: float = 0.0

    LIVE = (
        "slots",
        "latency_ms",
        "per_token_ms",
        "contention",
        "jitter",
        "max_queue",
        "fault_rate",
        "fault_kinds",
        "metrics_format",
        "step_ms",
        "seq_step_ms",
        "max_num_seqs",
        "kv_tokens",
        "kv_blocks",
        "kv_prompt_tokens",
        "prefill_tokens",
        "preempt_after",
        "recompute",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse values the capacity model cannot honour, so a typo fails loudly instead of hanging a run."""
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if not _is_int(self.slots) or self.slots < 1:
            raise ValueError(f"slots must be an integer >= 1, got {self.slots!r}")
        self._validate_batching()
        for name in ("latency_ms", "per_token_ms", "contention", "jitter", "retry_after_s", "hang_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.max_queue is not None and (not isinstance(self.max_queue, int) or self.max_queue < 0):
            raise ValueError(f"max_queue must be an integer >= 0 or null, got {self.max_queue!r}")
        if self.difficulty not in DIFFICULTIES:
            raise ValueError(f"difficulty must be one of {', '.join(DIFFICULTIES)}, got {self.difficulty!r}")
        for name in ("fault_rate", "correct_rate", "settled_share"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {value!r}")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens}..{self.max_tokens}")
        parse_fault_kinds(",".join(self.fault_kinds))
        if self.metrics_format not in METRICS_FORMATS:
            raise ValueError(
                f"metrics_format must be one of {', '.join(METRICS_FORMATS)}, got {self.metrics_format!r}"
            )

    def _validate_batching(self) -> None:
        """The batching model's knobs; a decode step must cost something, or the engine is infinitely fast."""
        for name in ("step_ms", "seq_step_ms", "recompute"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.step_ms + self.seq_step_ms <= 0:
            raise ValueError("step_ms and seq_step_ms cannot both be 0: a decode step must take some time")
        if not _is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}")
        for name in ("kv_prompt_tokens", "prefill_tokens", "prefix_cache_prompts"):
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("kv_tokens", "kv_blocks", "preempt_after"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or null, got {value!r}")
        if not _is_int(self.block_size) or self.block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        if self.kv_tokens is not None and self.kv_blocks is not None:
            raise ValueError(
                "kv_tokens (a reservation per request) and kv_blocks (a paged cache that grows and preempts) "
                "are two KV models: set one of them"
            )

    def update(self, changes: dict[str, object]) -> None:
        """Apply a live change atomically: on any bad value nothing changes."""
        if not isinstance(changes, dict):
            raise ValueError("expected a JSON object of settings")
        unknown = [key for key in changes if key not in self.LIVE]
        if unknown:
            raise ValueError(
                f"{', '.join(unknown)} cannot be changed live; changeable: {', '.join(self.LIVE)}"
            )
        before = dict(self.__dict__)
        try:
            for key, value in changes.items():
                if key == "fault_kinds":
                    value = parse_fault_kinds(value if isinstance(value, str) else ",".join(value))  # type: ignore[arg-type]
                setattr(self, key, value)
            self.validate()
        except (ValueError, TypeError):
            self.__dict__.update(before)
            raise


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def parse_fault_kinds(text: str) -> tuple[str, ...]:
    """'429,reset' -> ('429', 'reset'); unknown kinds are an error naming the valid ones."""
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown}; choose from {', '.join(FAULT_KINDS)}")
    return kinds
