"""How much of a rollout's time verification takes, and whether it, not the backend, limits throughput.

Diagnosis and tuning both read it off their steps: each step times every rollout's backend call and its
verification, so when the verification time per rollout grows with load faster than the backend's, the
checks are queueing for a core (or a verifier process), and more parallelism cannot help; more verifier
processes can, up to the machine's cores.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from rollflow.tasks.tuning.probe import StepResult

# Verification is the limit when it is at least this share of a rollout's time at the higher level.
VERIFY_SHARE = 0.5


@dataclass
class VerifyLoad:
    """Verification at one step: per rollout, as a share of each rollout's time, and where it ran."""

    ms_per_rollout: float
    share: float
    processes: int | None  # verifier processes; 0: a thread of the collecting process; None: on the loop

    @classmethod
    def of(cls, step: StepResult, processes: int | None) -> VerifyLoad:
        backend, verify = step.per_rollout(step.backend_s), step.per_rollout(step.verify_s)
        total = backend + verify
        return cls(verify * 1000, verify / total if total > 0 else 0.0, processes)

    def where(self) -> str:
        if self.processes is None:
            return "on the event loop"
        if self.processes == 0:
            return "in one thread of the collecting process (--verify-processes 0)"
        return f"in {self.processes} verifier process{'es' if self.processes > 1 else ''}"

    def clause(self) -> str:
        return (
            f"verification {self.ms_per_rollout:,.1f} ms per rollout, {self.share:.0%} of each rollout's "
            f"time, {self.where()}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "verify_ms_per_rollout": round(self.ms_per_rollout, 3),
            "verify_share": round(self.share, 3),
            "verify_processes": self.processes,
        }


def verification_limits(lower: StepResult, upper: StepResult) -> bool:
    """Whether verification, not the backend, held throughput back between two levels."""
    b_lo, b_hi = lower.per_rollout(lower.backend_s), upper.per_rollout(upper.backend_s)
    v_lo, v_hi = lower.per_rollout(lower.verify_s), upper.per_rollout(upper.verify_s)
    share = VerifyLoad.of(upper, None).share
    return share >= VERIFY_SHARE and v_hi - v_lo >= b_hi - b_lo


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def verify_next_step(processes: int | None) -> str:
    """What to change when verification limits the run."""
    have = cores()
    if processes is None:
        return (
            "Verification runs on the event loop (an http or async verifier): give it more capacity "
            "(more /verify workers) or use a cheaper verifier; more parallelism will not help."
        )
    if processes < have:
        return (
            f"Run more verifier processes: --verify-processes {have} (this machine has {have} cores; "
            f"now {processes or 'a thread of the collecting process'}), or use a cheaper verifier "
            f"(math_fast for numeric answers); more parallelism will not help."
        )
    return (
        f"Every core already verifies ({processes} processes on {have} cores): spread the run over more "
        f"machines (--runner dask) or use a cheaper verifier (math_fast for numeric answers); more "
        f"parallelism will not help."
    )
