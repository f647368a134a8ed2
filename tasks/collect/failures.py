"""The failure record: one line per rollout that has no reward, written by collection and reverify alike.

It keeps what the row needs to be completed later (`reverify --failed-only`): the row as sent, the reply
under `output` when a check failed on it, and the `_rf` (attempts, seed) the completed row will carry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollflow.tasks.backends.backends import BackendError
from rollflow.tasks.storage import rowjson


def failure_line(
    key: tuple[int, int],
    exc: BackendError,
    row: dict[str, Any] | None,
    scrub: Callable[[str], str],
    *,
    output: dict[str, Any] | None = None,
    rf: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> bytes:
    """The record of rollout `key` that failed with `exc`; a row no JSON line holds is left to the input."""
    error: dict[str, Any] = {
        "kind": exc.kind,
        "status": exc.status,
        "attempts": exc.attempts,
        "message": scrub(str(exc)),
    }
    body = getattr(exc, "body", None)
    if body:
        error.update(url=exc.url, body=scrub(body))
    record: dict[str, Any] = {
        "_ng_task_index": key[0],
        "_ng_rollout_index": key[1],
        "error": error,
        "row": row,
    }
    record.update(extra or {})
    if output is not None:
        record["output"] = output  # a failed check's reply, so it can be scored again later
        if rf is not None:
            record["_rf"] = rf  # what the row it completes would carry
    try:
        return rowjson.dumps(record)
    except (TypeError, ValueError) as dump_error:
        record["row"] = None
        record.pop("output", None)
        record["row_not_stored"] = f"{type(dump_error).__name__}: {dump_error}; see the input file"
        return rowjson.dumps(record)


def rollflow_fields(attempts: int, seed: Any) -> dict[str, Any]:
    """A collected row's `_rf`: its attempts, and the seed it was sent (a failure record keeps the same,
    so `reverify --failed-only` completes it into the row collection would have written)."""
    rf: dict[str, Any] = {"attempts": attempts}
    if seed is not None:
        rf["seed"] = seed
    return rf
