"""How much of a rollout's time verification takes, and whether it, not the backend, limits throughput.

Diagnosis and tuning both read it off their steps: each step times every rollout's backend call and its
verification, so when the verification time per rollout grows with load faster than the backend's, the
checks are queueing for a core (or a verifier process), and more parallelism cannot help; more verifier
processes can, up to the machine's cores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rollflow.tasks.tuning.probe import StepResult
from rollflow.tasks.verify.pool import cores

# Verifiers on the event loop: verification is the limit when it is at least this share of a rollout's
# time at the higher level and grew with load at least as fast as the backend's part.
VERIFY_SHARE = 0.5
# CPU-bound checks: the limit when the step ran at this share of what verification can sustain.
AT_CAPACITY = 0.8


@dataclass
class VerifyLoad:
    """Verification at one step: per rollout, as a share of each rollout's time, where it ran, and (for
    CPU-bound checks) the rollouts/s it can sustain there beside the step's rate."""

    ms_per_rollout: float
    share: float
    processes: int | None  # verifier processes; 0: a thread of the collecting process; None: on the loop
    capacity: float | None = None
    rate: float = 0.0

    @classmethod
    def of(cls, step: StepResult, processes: int | None) -> VerifyLoad:
        backend, verify = step.per_rollout(step.backend_s), step.per_rollout(step.verify_s)
        total = backend + verify
        share = verify / total if total > 0 else 0.0
        return cls(verify * 1000, share, processes, capacity(step, processes), step.rollouts_per_s)

    def where(self) -> str:
        if self.processes is None:
            return "on the event loop"
        if self.processes == 0:
            return "in one thread of the collecting process (--verify-processes 0)"
        return f"in {self.processes} verifier process{'es' if self.processes > 1 else ''}"

    def clause(self) -> str:
        sustain = ""
        if self.capacity is not None:
            sustain = (
                f"; verification sustains {self.capacity:,.0f} rollouts/s there, the run made "
                f"{self.rate:,.0f}"
            )
        return (
            f"verification {self.ms_per_rollout:,.1f} ms per rollout, {self.share:.0%} of each rollout's "
            f"time, {self.where()}{sustain}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "verify_ms_per_rollout": round(self.ms_per_rollout, 3),
            "verify_share": round(self.share, 3),
            "verify_processes": self.processes,
            "verify_capacity_per_s": None if self.capacity is None else round(self.capacity, 1),
        }


def capacity(step: StepResult, processes: int | None) -> float | None:
    """Rollouts/s that CPU-bound verification can sustain, from what the step's checks took.

    In a pool: its processes over the busy time per check. In a thread: one core (the GIL) over the
    collecting process's CPU per rollout, when the checks are most of that CPU (else the process's own
    work is the limit, not verification). None for verifiers on the event loop or without checks.
    """
    u = step.usage
    if processes is None or u.checks == 0:
        return None
    if processes > 0:
        return processes * u.checks / u.verify_busy_s if u.verify_busy_s > 0 else None
    if u.process_cpu_s <= 0 or u.verify_cpu_s < 0.5 * u.process_cpu_s:
        return None
    return u.checks / u.process_cpu_s


def verification_limits(lower: StepResult, upper: StepResult, processes: int | None) -> bool:
    """Whether verification, not the backend, held throughput back at `upper` (from `lower` up)."""
    if processes is not None:
        sustain = capacity(upper, processes)
        return sustain is not None and upper.rollouts_per_s >= AT_CAPACITY * sustain
    b_lo, b_hi = lower.per_rollout(lower.backend_s), upper.per_rollout(upper.backend_s)
    v_lo, v_hi = lower.per_rollout(lower.verify_s), upper.per_rollout(upper.verify_s)
    share = VerifyLoad.of(upper, None).share
    return share >= VERIFY_SHARE and v_hi - v_lo >= b_hi - b_lo


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
