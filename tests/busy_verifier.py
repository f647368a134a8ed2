"""A CPU-bound verifier: about 2 ms of pure-Python work per check (a fixed count of operations)."""

from __future__ import annotations

from typing import Any


def score(row: dict[str, Any], text: str) -> float:
    acc = 0
    for i in range(40_000):
        acc += i * i % 7
    return 1.0 if acc >= 0 and text.rstrip().endswith(f"\\boxed{{{row.get('expected_answer')}}}") else 0.0
