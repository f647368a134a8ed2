"""A verifier that disagrees with the collection's: the reply's length, odd or even (it splits tasks)."""

from __future__ import annotations

from typing import Any


def by_parity(row: dict[str, Any], text: str) -> float:
    return float(len(text) % 2)
