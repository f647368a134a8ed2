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


def chunk_size_value(text: str) -> int | str:
    if text.lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of input rows or auto, not {text!r}")
    return value


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
