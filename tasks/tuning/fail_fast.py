"""Tuning stops at once when the backend answers no request, and says what it answered instead.

A wrong URL or key makes every probe fail; measuring a curve of failures would send hundreds of requests
and end in "no parallelism worked". The probe step stops handing out work after FAIL_FAST failures with
no success, and BackendRejects carries the first failure's status, URL and scrubbed body excerpt, and
the failure lines, which the flow writes beside the report.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import orjson

from rollflow.tasks.collect.rollouts import RolloutBatch, RolloutKey, WorkItem

FAIL_FAST = 10  # failed rollouts in a row, from a step's start, before tuning gives up on the backend
FAILURES_FILE = "tuning_failures.jsonl"


class TuningError(RuntimeError):
    """Diagnosis or tuning cannot go on with this input or backend; the message says what to change."""

    def named(self, url: str) -> TuningError:
        """The same error, naming the endpoint it happened at (when tuning several)."""
        return TuningError(f"Endpoint {url}: {self}")


class BackendRejects(TuningError):
    """Every probe rollout failed: the message names what the backend answered; `failures` the lines."""

    def __init__(self, message: str, failures: dict[RolloutKey, bytes]) -> None:
        super().__init__(message)
        self.failures = failures

    def named(self, url: str) -> BackendRejects:
        return BackendRejects(f"Endpoint {url}: {self}", self.failures)

    def written_to(self, output: str) -> BackendRejects:
        """The same error, naming where the failures were written."""
        where = f"{output.rstrip('/')}/{FAILURES_FILE}"
        return BackendRejects(str(self).replace(f"<output>/{FAILURES_FILE}", where), self.failures)

    def as_dict(self) -> dict[str, Any]:
        return {"message": str(self), "failed_rollouts": len(self.failures), "failures": FAILURES_FILE}

    def lines(self) -> bytes:
        return b"".join(line + b"\n" for _, line in sorted(self.failures.items()))


def until_all_fail(items: Iterable[WorkItem], batch: RolloutBatch, n: int = FAIL_FAST) -> Iterator[WorkItem]:
    """`items` until `n` rollouts failed and none succeeded; the step then ends with what is in flight."""
    for item in items:
        if all_failed(batch, n):
            return
        yield item


def all_failed(batch: RolloutBatch, n: int = FAIL_FAST) -> bool:
    return not batch.results and len(batch.failures) >= n


def first_failure(batch: RolloutBatch) -> str:
    """The message of the step's first failed rollout (in task order), or "" when none failed."""
    if not batch.failures:
        return ""
    return str(orjson.loads(batch.failures[min(batch.failures)])["error"]["message"])


def failures_said(kinds: Counter[str], first: str) -> str:
    """What the failed attempts of unreliable levels were, so "no level worked" names its cause."""
    if not kinds:
        return ""
    counted = ", ".join(f"{n} {kind}" for kind, n in kinds.most_common())
    return (
        f" The failed attempts: {counted}; the first failure: {first.rstrip('.')}."
        if first
        else f" The failed attempts: {counted}."
    )


def rejection(batch: RolloutBatch, parallelism: int) -> BackendRejects:
    """The error of a step in which every rollout failed: how many, of which kinds, and the first reason."""
    errors = [orjson.loads(line)["error"] for _, line in sorted(batch.failures.items())]
    kinds = Counter(e["kind"] for e in errors)
    first = errors[0]
    return BackendRejects(
        f"Tuning stopped: all {len(errors)} probe rollouts at parallelism {parallelism} failed "
        f"({', '.join(f'{n} {kind}' for kind, n in kinds.most_common())}), so the backend answers no "
        f"request and no parallelism can be measured. The first failure: {first['message']} "
        f"Fix the backend or its URL, then run the same command again; the failures are in "
        f"<output>/{FAILURES_FILE}.",
        dict(batch.failures),
    )
