"""JSON for rows: orjson on the hot path, the standard library for the rare row orjson cannot hold exactly.

orjson reads an integer beyond 64 bits as a float and refuses to write one, so an `expected_answer` of
2**100 would reach the dataset as 1.2676506002282294e+30. A line that may hold such a number (a run of 19
digits) is read again with `json`, which keeps integers of any size; writing falls back the same way.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

# orjson writes 254 nested containers; a failure record wraps the row once more, and one level is spare.
MAX_ROW_DEPTH = 252
# Every ASCII digit read as "0" (only a digit becomes one): a run of 19 digits is then a plain substring,
# found by a byte search at a tenth of the cost of the regular expression \d{19} (every reply passes).
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_DIGITS = b"0" * 19
_EXACT_LOADS = json.JSONDecoder()


def loads(data: bytes) -> Any:
    """Parse one JSON document; integers keep their exact value whatever their size.

    orjson parses first either way, so invalid JSON raises orjson.JSONDecodeError with its message.
    """
    value = orjson.loads(data)
    if _LONG_DIGITS not in data.translate(_DIGITS_AS_ZERO):
        return value
    return _EXACT_LOADS.decode(data.decode("utf-8"))


def is_reward(value: Any) -> bool:
    """A value a row may carry as its reward: a finite int or float, never a bool (the one check)."""
    # a tuple, not `int | float`: isinstance checks a union several times slower, once per rollout
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def dumps(value: Any) -> bytes:
    """Serialise compactly; raises orjson.JSONEncodeError for what no JSON line can hold (too deep)."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        if "64-bit" not in str(exc):
            raise
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def depth(value: Any) -> int:
    """How many containers nest in `value` (a scalar is 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        level += 1
        deepest = max(deepest, level)
        stack.extend((child, level) for child in item)
    return deepest


def too_deep(line: bytes, value: Any) -> bool:
    """Whether `value` nests beyond MAX_ROW_DEPTH; the bracket count spares most rows the walk."""
    return line.count(b"[") + line.count(b"{") > MAX_ROW_DEPTH and depth(value) > MAX_ROW_DEPTH


RolloutKey = tuple[int, int]  # (_ng_task_index, _ng_rollout_index): one rollout of the dataset


class RowError(ValueError):
    """A line that is not a dataset row: what is wrong, and where when the reader knows it."""

    def __init__(self, problem: str, where: str | None = None, line: int | None = None) -> None:
        self.problem, self.where, self.line = problem, where, line
        place = f"{where}, line {line}: " if where and line else (f"line {line}: " if line else "")
        super().__init__(place + problem)

    def at(self, where: str | None, line: int) -> RowError:
        return RowError(self.problem, where, line)


def read_row(line: bytes, where: str | None = None, lineno: int | None = None) -> dict[str, Any]:
    """The one reader of dataset rows and failure records: a JSON object with exact integers, or RowError."""
    try:
        row = loads(line)
    except RecursionError:  # nested past what the exact re-read of a long integer can descend
        raise RowError(f"the row nests deeper than {MAX_ROW_DEPTH} levels", where, lineno) from None
    except orjson.JSONDecodeError as exc:
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as uexc:
            raise RowError(
                f"the line is not UTF-8 ({uexc.reason} at byte {uexc.start})", where, lineno
            ) from None
        raise RowError(f"the line is not valid JSON ({exc})", where, lineno) from None
    if not isinstance(row, dict):
        raise RowError(f"expected a JSON object, got {type(row).__name__}", where, lineno)
    return row


def rollout_key(row: dict[str, Any], where: str | None = None, lineno: int | None = None) -> RolloutKey:
    """(task, rollout) of a row or failure record: both whole numbers, or RowError."""
    task, rollout = row.get("_ng_task_index"), row.get("_ng_rollout_index")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (task, rollout)):
        raise RowError(
            f"_ng_task_index and _ng_rollout_index must be whole numbers, got {task!r}, {rollout!r}",
            where,
            lineno,
        )
    return task, rollout  # type: ignore[return-value]


def read_keyed(
    line: bytes, where: str | None = None, lineno: int | None = None
) -> tuple[dict[str, Any], RolloutKey]:
    """A row read whole and its (task, rollout): a line cut after its keys is refused, never half-read."""
    row = read_row(line, where, lineno)
    return row, rollout_key(row, where, lineno)


def failure_kind(line: bytes) -> str:
    """The `error.kind` of a failure record, as counted by collection and reverify alike."""
    error = read_row(line).get("error")
    return str(error.get("kind") if isinstance(error, dict) else None)
