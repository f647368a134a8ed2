"""Per-rollout sampling seeds: the same (base seed, task, rollout) gives the same seed on every run,
resume, replica and worker, so a deterministic engine returns the same rollout each time."""

from __future__ import annotations

import hashlib
import json
from typing import Any

SEED_BITS = 31  # vLLM, SGLang and OpenAI all accept a non-negative 32-bit signed integer


def rollout_seed(base: int, task_index: int, rollout_index: int) -> int:
    """A stable 31-bit hash of (base, task, rollout); never Python's salted hash()."""
    digest = hashlib.sha256(b"rollflow-seed\x00%d\x00%d\x00%d" % (base, task_index, rollout_index)).digest()
    return int.from_bytes(digest[:4], "big") & ((1 << SEED_BITS) - 1)


def seeded(
    row: dict[str, Any],
    base: int | None,
    task_index: int,
    rollout_index: int,
    *,
    agent: bool = False,
    repeat_seed: bool = False,
) -> tuple[dict[str, Any], Any]:
    """The row to send and the seed it carries. A seed already in its parameters (from the row or
    --overrides) wins; without --seed the row goes as it is.

    An agent row carries its seed where NeMo Gym's agents take one, in metadata.extra_body (its
    request schema refuses a top-level `seed`); `repeat_seed` sends the rollout index there, as
    NeMo Gym's +num_repeats_add_seed does.
    """
    params = row.get("responses_create_params")
    if not isinstance(params, dict):
        return row, None
    if "seed" in params:
        return row, params["seed"]
    if agent:
        return _agent_seeded(row, params, base, task_index, rollout_index, repeat_seed)
    if base is None:
        return row, None
    seed = rollout_seed(base, task_index, rollout_index)
    return {**row, "responses_create_params": {**params, "seed": seed}}, seed


def _agent_seeded(
    row: dict[str, Any],
    params: dict[str, Any],
    base: int | None,
    task_index: int,
    rollout_index: int,
    repeat_seed: bool,
) -> tuple[dict[str, Any], Any]:
    metadata = params.get("metadata")
    extra = metadata.get("extra_body") if isinstance(metadata, dict) else None
    try:
        extra_body = json.loads(extra) if isinstance(extra, str) else {}
    except ValueError:
        extra_body = None
    if not isinstance(extra_body, dict):
        return row, None  # an extra_body that is not a JSON object is sent as it is, unseeded
    if "seed" in extra_body:
        return row, extra_body["seed"]
    if base is not None:
        seed = rollout_seed(base, task_index, rollout_index)
    elif repeat_seed:
        seed = rollout_index
    else:
        return row, None
    extra_body["seed"] = seed
    metadata = {**(metadata if isinstance(metadata, dict) else {}), "extra_body": json.dumps(extra_body)}
    return {**row, "responses_create_params": {**params, "metadata": metadata}}, seed
