"""A verifier whose import takes 3 s (a large model or library loading): its processes' cold start."""

from __future__ import annotations

import time
from typing import Any

time.sleep(3.0)


def score(row: dict[str, Any], text: str) -> float:
    return 1.0 if text.rstrip().endswith(f"\\boxed{{{row.get('expected_answer')}}}") else 0.0
