"""One rollout scored again: its stored response read as the verifier's text, the old reward kept under `_rf`.

No backend is asked: the verifier is the collection's (same settings, pool, timeouts), and so are its
failure kinds (verifier, verifier_timeout, verifier_crash, no_reward): a failure is no reward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollflow.settings import redact
from rollflow.tasks.backends.backends import BackendError, RolloutResult
from rollflow.tasks.backends.replies import responses_text
from rollflow.tasks.collect.failures import failure_line
from rollflow.tasks.collect.rollouts import check_reward
from rollflow.tasks.storage import rowjson
from rollflow.tasks.verify.verifiers import Verifier

# What the rollout produced or rollflow added; the rest is the row the verifier saw when collecting.
OUTPUT_KEYS = frozenset({"response", "reward", "_ng_task_index", "_ng_rollout_index", "_rf"})


def verifier_row(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in OUTPUT_KEYS}


def _result(row: dict[str, Any]) -> RolloutResult:
    response = row.get("response")
    if not isinstance(response, dict):
        raise BackendError(
            f"the row has no response object to score (found {type(response).__name__})", kind="malformed"
        )
    return RolloutResult({"response": response}, None, responses_text(response), 0, 0.0, 1)


async def new_reward(verifier: Verifier, row: dict[str, Any]) -> float:
    """The verifier's reward for the row's stored response; BackendError (a failure kind) otherwise."""
    result = _result(row)
    try:
        reward = await verifier(verifier_row(row), result)
    except BackendError:
        raise
    except Exception as exc:
        raise BackendError(f"verifier failed: {type(exc).__name__}: {exc}", kind="verifier") from exc
    return check_reward(reward, 1, none="the verifier gave none")


def plain_reward(check: Callable[[dict[str, Any], str], float], row: dict[str, Any]) -> float:
    """new_reward for a check cheap enough to call inline (exact_match, math_fast): same failure kinds."""
    result = _result(row)
    try:
        reward = float(check(verifier_row(row), result.text))  # as collection's threaded check does
    except Exception as exc:
        raise BackendError(f"verifier failed: {type(exc).__name__}: {exc}", kind="verifier") from exc
    return check_reward(reward, 1, none="the verifier gave none")


def rescored_line(row: dict[str, Any], reward: float, verifier_name: str) -> bytes:
    """The same row and response with the new reward; the previous one (None if it had none) under _rf."""
    out = dict(row)
    previous = row.get("reward")
    out["reward"] = reward
    rf = dict(row.get("_rf") or {})
    rf["previous_reward"] = previous
    rf["reverified_with"] = verifier_name
    out["_rf"] = rf
    return rowjson.dumps(out)


def failed_line(row: dict[str, Any], exc: BackendError) -> bytes:
    """Collection's failure record, with the stored response under `output` and the old reward kept."""
    key = (row["_ng_task_index"], row["_ng_rollout_index"])
    extra = {"previous_reward": row.get("reward")}
    output = {"response": row.get("response")}
    return failure_line(
        key, exc, verifier_row(row), redact.redact, output=output, rf=row.get("_rf"), extra=extra
    )


def row_of_failure(record: dict[str, Any]) -> dict[str, Any]:
    """A failure record as the output row it would have been, to score again."""
    row = {**(record.get("row") or {}), **(record.get("output") or {})}
    row["reward"] = record.get("previous_reward")  # a collection's failure had none
    row["_ng_task_index"] = record["_ng_task_index"]
    row["_ng_rollout_index"] = record["_ng_rollout_index"]
    if "_rf" in record:
        row["_rf"] = record["_rf"]
    return row
