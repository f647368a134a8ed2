"""A `module:function` verifier that does about 2 ms of pure-Python work per check on this machine (a
fixed count of operations, not a sleep), then compares the last \\boxed{} with expected_answer."""

from __future__ import annotations

from typing import Any

WORK = 40_000


def score(row: dict[str, Any], text: str) -> float:
    acc = 0
    for i in range(WORK):
        acc += i * i % 7
    start = text.rfind("\\boxed{")
    answer = text[start + 7 : text.find("}", start)] if start >= 0 else None
    return 1.0 if acc >= 0 and answer == str(row.get("expected_answer")) else 0.0
