"""Per-rollout sampling seeds: the same (base seed, task, rollout) gives the same seed on every run,
resume, replica and worker, so a deterministic engine returns the same rollout each time."""

from __future__ import annotations

import hashlib
from typing import Any

SEED_BITS = 31  # vLLM, SGLang and OpenAI all accept a non-negative 32-bit signed integer


def rollout_seed(base: int, task_index: int, rollout_index: int) -> int:
    """A stable 31-bit hash of (base, task, rollout); never Python's salted hash()."""
    digest = hashlib.sha256(b"rollflow-seed\x00%d\x00%d\x00%d" % (base, task_index, rollout_index)).digest()
    return int.from_bytes(digest[:4], "big") & ((1 << SEED_BITS) - 1)


def seeded(
    row: dict[str, Any], base: int | None, task_index: int, rollout_index: int
) -> tuple[dict[str, Any], Any]:
    """The row to send and the seed it carries. A seed already in its parameters (from the row or
    --overrides) wins; without --seed the row goes as it is."""
    params = row.get("responses_create_params")
    if not isinstance(params, dict):
        return row, None
    if "seed" in params:
        return row, params["seed"]
    if base is None:
        return row, None
    seed = rollout_seed(base, task_index, rollout_index)
    return {**row, "responses_create_params": {**params, "seed": seed}}, seed
