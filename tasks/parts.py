"""Part objects: finished rollouts of a chunk saved before the chunk commits (probe and tuning output).

A part is written whole, like every object, under parts/<chunk>/<name>.jsonl. When the chunk runs it
adopts the rollouts its parts hold instead of asking the backend again, and once the chunk commits its
parts are deleted. A part that cannot be read is ignored: its rollouts are simply collected again.
"""

from __future__ import annotations

import orjson

from tasks.storage import Store

PARTS_DIR = "parts"

RolloutKey = tuple[int, int]


def part_dir(chunk: int) -> str:
    return f"{PARTS_DIR}/{chunk:05d}"


def write_part(store: Store, chunk: int, name: str, lines: list[bytes]) -> None:
    if lines:
        store.write_bytes(f"{part_dir(chunk)}/{name}.jsonl", b"".join(line + b"\n" for line in lines))


def read_parts(store: Store, chunk: int) -> tuple[dict[RolloutKey, bytes], list[str]]:
    """Rollouts held by a chunk's parts, and a note for each part that could not be used."""
    kept: dict[RolloutKey, bytes] = {}
    problems: list[str] = []
    for name in store.list(part_dir(chunk)):
        rel = f"{part_dir(chunk)}/{name}"
        try:
            found: dict[RolloutKey, bytes] = {}
            for line in store.read_bytes(rel).splitlines():
                if line.strip():
                    row = orjson.loads(line)
                    found[(row["_ng_task_index"], row["_ng_rollout_index"])] = line
        except (orjson.JSONDecodeError, KeyError, TypeError, OSError) as exc:
            problems.append(f"part {rel} is unreadable ({type(exc).__name__}); its rollouts are redone")
            continue
        kept.update(found)
    return kept, problems


def delete_parts(store: Store, chunk: int) -> None:
    store.delete_tree(part_dir(chunk))
