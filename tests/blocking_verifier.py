"""A synchronous verifier that blocks for longer than a short lease lifetime (a slow grader, a CPU-bound
check): it must not stop the run from renewing its lease."""

from __future__ import annotations

import time

BLOCK_S = 2.5


def verify(row: dict, text: str) -> float:
    time.sleep(BLOCK_S)
    return 1.0 if text.rstrip().endswith(f"\\boxed{{{row.get('expected_answer')}}}") else 0.0
