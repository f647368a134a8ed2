"""diagnose-bottleneck: the same number of rows at a low and a high parallelism, and what limits the run.

The NeMo Gym recipe by hand: if throughput doubled from 5 to 20 in flight, parallelism was the limit;
if it grew under 20%, the model server or the verifier is; errors mean too much. CPU-bound checks that
ran at their measured capacity at the high level are the limit whatever the ratio. `verdict()` is that
rule with the figures attached (pure, unit-tested); `diagnose()` runs the two steps as real rollouts.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from rollflow.tasks.backends.engine_metrics import EngineSampler
from rollflow.tasks.collect.plan import RunPlan
from rollflow.tasks.collect.rollouts import CollectContext
from rollflow.tasks.tuning.engine import engine_clause, engine_sampler
from rollflow.tasks.tuning.fail_fast import TuningError
from rollflow.tasks.tuning.probe import ProbeFeed, StepResult, probe_next
from rollflow.tasks.tuning.verify_load import VerifyLoad, verification_limits, verify_next_step

PARALLELISM_BOUND = 2.0
NO_GAIN = 1.2
ERROR_RATE = 0.02
RATE_LIMIT_RATE = 0.01
TIMEOUT_KINDS = ("timeout",)


@dataclass
class Diagnosis:
    """The verdict, the next step in plain words, and the figures behind it."""

    verdict: str
    next_step: str
    reason: str
    low: StepResult
    high: StepResult
    speedup: float
    figures: dict[str, Any] = field(default_factory=dict)
    # the most in flight the verdict advises: a ceiling ("at or below") or a level ("near"), else None
    advised: int | None = None
    ceiling: bool = False

    @property
    def probe_rollouts(self) -> int:
        return self.low.rollouts + self.high.rollouts

    @property
    def engine(self) -> dict[str, Any] | None:
        """The engine's figures at each level, when the backend publishes them (vLLM/SGLang /metrics)."""
        if self.low.engine is None and self.high.engine is None:
            return None
        return {
            str(st.parallelism): st.engine.as_dict() if st.engine is not None else None
            for st in (self.low, self.high)
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "advised_parallelism": self.advised,
            "advised_is_ceiling": self.ceiling,
            "next_step": self.next_step,
            "reason": self.reason,
            "speedup": round(self.speedup, 3),
            "low": self.low.as_dict(),
            "high": self.high.as_dict(),
            "throughput": {
                str(self.low.parallelism): round(self.low.rollouts_per_s, 3),
                str(self.high.parallelism): round(self.high.rollouts_per_s, 3),
            },
            "errors": {
                str(self.low.parallelism): self.low.errors,
                str(self.high.parallelism): self.high.errors,
            },
            "time_split": self.figures.get("time_split", {}),
            "verification": self.figures.get("verification", {}),
            "probe_rollouts": self.probe_rollouts,
            # the verifier processes' start, waited for before the first step: never counted as checks
            "verifier_start_s": self.figures.get("verifier_start_s"),
            **({"engine": self.engine} if self.engine is not None else {}),
        }


def time_split(low: StepResult, high: StepResult) -> dict[str, Any]:
    """Seconds per successful rollout spent in backend calls and in verification, at each level."""
    return {
        "backend_s_per_rollout": {
            str(low.parallelism): round(low.per_rollout(low.backend_s), 6),
            str(high.parallelism): round(high.per_rollout(high.backend_s), 6),
        },
        "verify_s_per_rollout": {
            str(low.parallelism): round(low.per_rollout(low.verify_s), 6),
            str(high.parallelism): round(high.per_rollout(high.verify_s), 6),
        },
        "backend_s": round(high.backend_s + low.backend_s, 6),
        "verify_s": round(high.verify_s + low.verify_s, 6),
    }


def overloaded(low: StepResult, high: StepResult) -> bool:
    """Errors that come with load: clearly more at the high level than at the low one.

    A backend that fails a steady few percent at any load is flaky, not over capacity: retries cover it.
    """
    hi_err, lo_err = high.measure.error_rate, low.measure.error_rate
    if hi_err > ERROR_RATE and hi_err > 2 * lo_err:
        return True
    hi_att, lo_att = high.attempt_error_rate, low.attempt_error_rate
    return hi_att > 2 * ERROR_RATE and hi_att > 2 * lo_att + ERROR_RATE


@dataclass
class _Reading:
    """The two steps and what every rule of `verdict` reads from them."""

    low: StepResult
    high: StepResult
    verify_processes: int | None
    speedup: float
    load: VerifyLoad
    rates: str

    @classmethod
    def of(cls, low: StepResult, high: StepResult, verify_processes: int | None) -> _Reading:
        lo_p, hi_p = low.parallelism, high.parallelism
        lo_r, hi_r = low.rollouts_per_s, high.rollouts_per_s
        speedup = hi_r / lo_r if lo_r > 0 else (float("inf") if hi_r > 0 else 0.0)
        rates = f"{lo_r:,.1f} rollouts/s at {lo_p} in flight, {hi_r:,.1f} at {hi_p} (x{speedup:.2f})"
        if high.engine is not None:
            rates = f"{engine_clause(high.engine, hi_p)}; {rates}"
        return cls(low, high, verify_processes, speedup, VerifyLoad.of(high, verify_processes), rates)

    def done(
        self, name: str, next_step: str, reason: str, advised: int | None = None, ceiling: bool = False
    ) -> Diagnosis:
        figures: dict[str, Any] = {
            "time_split": time_split(self.low, self.high),
            "verification": self.load.as_dict(),
        }
        return Diagnosis(
            name, next_step, reason, self.low, self.high, self.speedup, figures, advised, ceiling
        )


def verdict(low: StepResult, high: StepResult, verify_processes: int | None = None) -> Diagnosis:
    """What limits throughput, judged from a low and a high step (see the module docstring).

    `verify_processes`: where checks run (verifier processes; 0, a thread; None, the event loop).
    The rules are tried in order; the first that holds is the verdict."""
    r = _Reading.of(low, high, verify_processes)
    for rule in (_rate_limited, _over_capacity, _parallelism_bound, _saturated):
        found = rule(r)
        if found is not None:
            return found
    lo_p, hi_p = low.parallelism, high.parallelism
    return r.done(
        "partly-parallelism-bound",
        f"Some gain (x{r.speedup:.2f}): the backend starts to saturate between {lo_p} and {hi_p} in flight. "
        f"Tuning will search between them and a little above to find the knee.",
        f"{r.rates}; latency p50 {_ms(low.measure.p50_s)} -> {_ms(high.measure.p50_s)}.",
    )


def _rate_limited(r: _Reading) -> Diagnosis | None:
    """429s on at least 1% of the high step's attempts: a quota, not a capacity."""
    low, high = r.low, r.high
    lo_p, hi_p = low.parallelism, high.parallelism
    limited = high.rate_limited
    if not (limited and limited >= max(1, RATE_LIMIT_RATE * high.attempts)):
        return None
    return r.done(
        "rate-limited",
        f"The backend is refusing requests with 429 Too Many Requests: you are at its rate limit or "
        f"quota, not its capacity. Run at or below {lo_p if low.rate_limited else hi_p} in flight, or "
        f"raise the quota; more parallelism only buys more refusals.",
        f"{limited} of {high.attempts} attempts at {hi_p} in flight were answered 429 "
        f"({low.rate_limited} at {lo_p}); {r.rates}.",
        advised=lo_p if low.rate_limited else hi_p,
        ceiling=True,
    )


def _over_capacity(r: _Reading) -> Diagnosis | None:
    """Errors that come with load (see `overloaded`)."""
    low, high = r.low, r.high
    lo_p, hi_p = low.parallelism, high.parallelism
    if not overloaded(low, high):
        return None
    hi_kinds = {**high.measure.errors}
    for kind, n in high.attempt_errors.items():
        hi_kinds[kind] = max(hi_kinds.get(kind, 0), n)
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(hi_kinds.items(), key=lambda kv: -kv[1]))
    timeouts = any(k in hi_kinds for k in TIMEOUT_KINDS)
    return r.done(
        "over-capacity",
        f"The backend is overloaded at {hi_p} in flight ({'timeouts' if timeouts else 'errors'} "
        f"appear). Stay at or below {lo_p} in flight, or give the backend more capacity; tuning will "
        f"stop below the level where errors start.",
        f"{high.errors} of {high.rollouts} rollouts failed at {hi_p} in flight ({kinds}) against "
        f"{low.errors} of {low.rollouts} at {lo_p}; {r.rates}.",
        advised=lo_p,
        ceiling=True,
    )


def _parallelism_bound(r: _Reading) -> Diagnosis | None:
    """Throughput at least doubled, and the engine did not start queueing between the two levels."""
    low, high = r.low, r.high
    lo_p, hi_p = low.parallelism, high.parallelism
    # The engine queueing at the high level but not at the low one puts the knee between them, whatever
    # the rates say (a loaded client reads the low level's rate short).
    knee_between = high.engine is not None and high.engine.saturated
    knee_between = knee_between and (low.engine is None or not low.engine.saturated)
    if r.speedup < PARALLELISM_BOUND or knee_between:
        return None
    return r.done(
        "parallelism-bound",
        f"More requests in flight pay off: throughput grew x{r.speedup:.2f} when parallelism went x"
        f"{hi_p / lo_p:.1f}. Tune upward from {hi_p} (`rollflow tune`, or `--parallelism auto`).",
        f"{r.rates}; latency p50 {_ms(low.measure.p50_s)} -> {_ms(high.measure.p50_s)}.",
    )


def _saturated(r: _Reading) -> Diagnosis | None:
    """No gain, or CPU-bound checks at their capacity: the verifier or the backend, whichever queues."""
    low, high, processes = r.low, r.high, r.verify_processes
    # CPU-bound checks at their measured capacity at the high level cap it, whatever a noisy ratio of two
    # short steps says: more in flight cannot pass what the checks sustain.
    checks_capped = processes is not None and verification_limits(low, high, processes)
    checks_capped = checks_capped and not (high.engine is not None and high.engine.saturated)
    if not (r.speedup < NO_GAIN or checks_capped):
        return None
    lo_p, hi_p = low.parallelism, high.parallelism
    b_lo, b_hi = low.per_rollout(low.backend_s), high.per_rollout(high.backend_s)
    v_lo, v_hi = low.per_rollout(low.verify_s), high.per_rollout(high.verify_s)
    split = f"per rollout: backend {_ms(b_lo)} -> {_ms(b_hi)}, verification {_ms(v_lo)} -> {_ms(v_hi)}"
    if _verifier_queues(r, b_hi - b_lo, v_hi - v_lo, v_hi > b_hi):
        return r.done(
            "verifier-bound",
            f"Verification is the bottleneck: the time to score a rollout grows with load while the "
            f"backend keeps up. {verify_next_step(processes)} Keep parallelism near "
            f"{lo_p if r.speedup < NO_GAIN else hi_p}.",
            f"{r.rates}; {split}; at {hi_p} in flight {r.load.clause()}.",
            advised=lo_p if r.speedup < NO_GAIN else hi_p,
        )
    return r.done(
        "backend-bound",
        f"The model server is saturated already at {lo_p} in flight: more parallelism only makes "
        f"requests wait in its queue. Add replicas/GPUs or a faster model; keep parallelism near "
        f"{lo_p} (tuning will find the exact knee).",
        f"{r.rates}; {split}.",
        advised=lo_p,
    )


def _verifier_queues(r: _Reading, backend_grew: float, verify_grew: float, verify_longer: bool) -> bool:
    """Whether the verifier rather than the backend is the one that queues; the best witness decides."""
    if r.high.engine is not None:  # the engine says whether it is the one that queues
        return not r.high.engine.saturated
    if r.verify_processes is not None:  # CPU-bound checks: judged by what they used
        return verification_limits(r.low, r.high, r.verify_processes)
    return verify_grew > backend_grew if max(verify_grew, backend_grew) > 0 else verify_longer


def reconcile(
    d: dict[str, Any], chosen: int, rate_at: dict[int, float], clean_above: bool = False
) -> tuple[int, str | None]:
    """The tuned choice squared with the verdict: a ceiling the verdict set (429s, errors with load) caps
    it; a choice far above a level it advised stands only with the rates that justify it, said in a note.

    `d`: the diagnosis as report.json holds it (so one read back from diagnosis.json serves as well);
    `rate_at`: the tuning's measured rollouts/s by parallelism; `clean_above`: no tuning step at or above
    the advised level saw an error or a refusal (a reused verdict is then out of date)."""
    advised, verdict = d.get("advised_parallelism"), d["verdict"]
    if advised is None or chosen <= advised:
        return chosen, None
    if d.get("advised_is_ceiling") and d.get("reused") and clean_above:
        return chosen, (
            f"not capped at {advised}: the reused diagnosis found {verdict} there, but tuning now measured "
            f"{chosen} without errors (the backend changed since; ROLLFLOW_TUNING__REUSE_DIAGNOSIS_S=0 "
            "diagnoses again)"
        )
    if d.get("advised_is_ceiling"):
        return advised, (
            f"capped at {advised}: the diagnosis found {verdict} (more in flight only bought refusals or "
            f"errors), where tuning alone chose {chosen}"
        )
    if chosen < 2 * advised:
        return chosen, None
    near = max((p for p in rate_at if p <= 2 * advised), default=None)
    if near is None:
        return chosen, f"the diagnosis said {verdict} near {advised}; tuning measured nothing near it"
    return chosen, (
        f"the diagnosis said {verdict}, near {advised} in flight, from two short steps; tuning chose "
        f"{chosen} because it measured {rate_at[chosen]:.1f}/s there against {rate_at[near]:.1f}/s at {near}"
        if chosen in rate_at
        else f"the diagnosis said {verdict} near {advised}; tuning chose {chosen}"
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f} ms"


async def diagnose(
    ctx: CollectContext,
    plan: RunPlan,
    low: int = 5,
    high: int = 20,
    rows: int = 100,
    feed: ProbeFeed | None = None,
    engine: EngineSampler | None = None,
) -> Diagnosis:
    """`rows` rollouts at `low` then as many fresh ones at `high` in flight; both kept as parts.

    The two steps use different rows of the input (each rollout is real and kept), of the same number,
    so the comparison is like for like without spending any rollout twice. The backend's /metrics is
    sampled meanwhile (through `engine`, or a sampler of its own); without it nothing changes.
    """
    own = feed is None
    feed = feed or ProbeFeed(ctx, plan)
    warm = getattr(ctx.verifier, "warm", None)
    started_s = await warm() if warm is not None else None  # the processes' start is no check time
    try:
        async with engine_sampler(ctx, engine) as sampler:
            lo = await probe_next(ctx, plan, feed, low, rows, f"diagnose-p{low}", sampler)
            hi = await probe_next(ctx, plan, feed, high, rows, f"diagnose-p{high}", sampler)
    finally:
        if own:
            feed.close()
    if lo is None or hi is None:
        raise TuningError(
            f"The input has too few rows left to diagnose ({feed.handed_out} rollouts available, "
            f"{2 * rows} needed); lower --diagnose-rows or skip diagnosis with a fixed --parallelism."
        )
    found = verdict(lo, hi, getattr(ctx.verifier, "processes", None))
    if started_s is not None:
        found.figures["verifier_start_s"] = round(started_s, 3)
    return found


DIAGNOSIS_FILE = "diagnosis.json"  # what `rollflow diagnose` writes into the output


def backend_key(what: dict[str, Any]) -> str:
    """What a diagnosis was of (the endpoints, the backend kind and model, the verifier and where its
    checks run), as a key: never the URLs themselves, which may carry a key in their query."""
    return hashlib.sha256(orjson.dumps(what, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def diagnosis_record(found: dict[str, Any], key: str, chosen: int) -> dict[str, Any]:
    """diagnosis.json: the stage's findings, with what they were of and when, so a later tune can reuse
    them. The value to run at is the verdict's ceiling when it set one."""
    d = found.get("diagnosis", {})
    if d.get("advised_is_ceiling") and isinstance(d.get("advised_parallelism"), int):
        chosen = min(chosen, d["advised_parallelism"])
    return {**found, "chosen_parallelism": chosen, "backend": key, "diagnosed_at": time.time()}


def earlier_diagnosis(raw: bytes, key: str, max_age_s: float) -> dict[str, Any] | None:
    """The diagnosis in a diagnosis.json of the same backend and checks, no older than `max_age_s`,
    marked as reused; None when it is of anything else, too old, of several endpoints, or malformed."""
    try:
        record = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    found = record.get("diagnosis") if isinstance(record, dict) else None
    if not isinstance(found, dict) or "endpoints" in found or not _well_formed(found):
        return None
    at = record.get("diagnosed_at")
    if record.get("backend") != key or isinstance(at, bool) or not isinstance(at, int | float):
        return None
    age = time.time() - at
    if not 0 <= age <= max_age_s:
        return None
    return {**found, "reused": f"the diagnosis in {DIAGNOSIS_FILE}, made {age:,.0f} s earlier"}


def _well_formed(found: dict[str, Any]) -> bool:
    advised = found.get("advised_parallelism")
    return (
        isinstance(found.get("verdict"), str)
        and (advised is None or (isinstance(advised, int) and not isinstance(advised, bool) and advised > 0))
        and isinstance(found.get("advised_is_ceiling", False), bool)
    )
