"""CPU-bound verifiers: about 2 ms (score) or 8 ms (score_8ms) of pure-Python work per check."""

from __future__ import annotations

from typing import Any


def _check(row: dict[str, Any], text: str, operations: int) -> float:
    acc = 0
    for i in range(operations):
        acc += i * i % 7
    return 1.0 if acc >= 0 and text.rstrip().endswith(f"\\boxed{{{row.get('expected_answer')}}}") else 0.0


def score(row: dict[str, Any], text: str) -> float:
    return _check(row, text, 40_000)


def score_8ms(row: dict[str, Any], text: str) -> float:
    """Four times the work: a thread of the collecting process is kept busy at 5 in flight too (at 2 ms
    the event loop's share of the GIL left it idle part of the time, so 5 -> 20 read a x1.2-1.3 gain)."""
    return _check(row, text, 160_000)
