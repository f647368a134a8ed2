"""Argument types the CLI parses itself, importable without the settings models (fast start)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def parallelism_value(text: str) -> int | str:
    if text in ("auto", "adaptive"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, auto or adaptive, not {text!r}") from None


def _count_or_auto(text: str, what: str, most: int | None = None) -> int | str:
    """A whole number from 1 (to `most`), or auto; else an error naming what is expected."""
    if text.lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or (most is not None and value > most):
        raise argparse.ArgumentTypeError(f"expected {what} or auto, not {text!r}")
    return value


def chunk_size_value(text: str) -> int | str:
    return _count_or_auto(text, "a number of input rows")


def collectors_value(text: str) -> int | str:
    return _count_or_auto(text, "a number of processes from 1 to 64", 64)


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected a JSON object such as '{{\"cores\": 8}}': {exc}"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, not {type(value).__name__}")
    return value
