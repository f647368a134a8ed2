"""Argument types the CLI parses itself, importable without the settings models (fast start)."""

from __future__ import annotations

import argparse


def parallelism_value(text: str) -> int | str:
    if text in ("auto", "adaptive"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, auto or adaptive, not {text!r}") from None
