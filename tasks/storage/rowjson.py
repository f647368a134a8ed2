"""JSON for rows: orjson on the hot path, the standard library for the rare row orjson cannot hold exactly.

orjson reads an integer beyond 64 bits as a float and refuses to write one, so an `expected_answer` of
2**100 would reach the dataset as 1.2676506002282294e+30. A line that may hold such a number (a run of 19
digits) is read again with `json`, which keeps integers of any size; writing falls back the same way.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

# orjson writes 254 nested containers; a failure record wraps the row once more, and one level is spare.
MAX_ROW_DEPTH = 252
_LONG_DIGITS = re.compile(rb"\d{19}")
_EXACT_LOADS = json.JSONDecoder()


def loads(data: bytes) -> Any:
    """Parse one JSON document; integers keep their exact value whatever their size.

    orjson parses first either way, so invalid JSON raises orjson.JSONDecodeError with its message.
    """
    value = orjson.loads(data)
    if _LONG_DIGITS.search(data) is None:
        return value
    return _EXACT_LOADS.decode(data.decode("utf-8"))


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
