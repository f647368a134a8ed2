"""Part objects: finished rollouts of a chunk saved before the chunk commits (probes and flushes).

A part is written whole, like every object, under parts/<chunk>/<name>.jsonl. Its first line is a header
naming the run (run_id) and chunk it was written for; when the chunk runs it adopts the rollouts of its
own run's parts instead of asking the backend again, and once the chunk commits its parts are deleted.
A part of another run, of another chunk, or one that cannot be read is ignored and reported: its
rollouts are simply collected again.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson

from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.storage.ledger import Ledger
from rollflow.tasks.storage.store import Store

PARTS_DIR = "parts"
HEADER_KEY = "_rf_part"

RolloutKey = tuple[int, int]


def part_dir(chunk: int) -> str:
    return f"{PARTS_DIR}/{chunk:05d}"


def part_header(run_id: str, chunk: int) -> bytes:
    return orjson.dumps({HEADER_KEY: {"run_id": run_id, "chunk": chunk}})


def write_part(store: Store, run_id: str, chunk: int, name: str, lines: Sequence[bytes]) -> None:
    if lines:
        body = b"".join(line + b"\n" for line in (part_header(run_id, chunk), *lines))
        store.write_bytes(f"{part_dir(chunk)}/{name}.jsonl", body)


def _parse_part(data: bytes, run_id: str, chunk: int, keys: range, repeats: int) -> dict[RolloutKey, bytes]:
    """The rollouts of one part; ValueError says why the part cannot be adopted."""
    lines = data.splitlines()
    header = orjson.loads(lines[0]).get(HEADER_KEY) if lines else None
    if not isinstance(header, dict):
        raise ValueError("it has no run header")
    if header.get("run_id") != run_id or header.get("chunk") != chunk:
        raise ValueError(f"it belongs to run {header.get('run_id')!r}, chunk {header.get('chunk')!r}")
    found: dict[RolloutKey, bytes] = {}
    for line in lines[1:]:
        if line.strip():
            row = orjson.loads(line)
            key = (row["_ng_task_index"], row["_ng_rollout_index"])
            if key[0] not in keys or not 0 <= key[1] < repeats:
                raise ValueError(f"it holds {key}, outside this chunk")
            found[key] = line
    return found


def read_parts(
    store: Store, run_id: str, chunk: int, keys: range, repeats: int
) -> tuple[dict[RolloutKey, bytes], list[str]]:
    """Rollouts held by this run's parts of `chunk` (tasks in `keys`), and a note per ignored part."""
    kept: dict[RolloutKey, bytes] = {}
    problems: list[str] = []
    for name in store.list(part_dir(chunk)):
        rel = f"{part_dir(chunk)}/{name}"
        try:
            found = _parse_part(store.read_bytes(rel), run_id, chunk, keys, repeats)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError, OSError) as exc:
            problems.append(f"part {rel} is unreadable or foreign ({exc}); its rollouts are redone")
            continue
        kept.update(found)
    return kept, problems


def chunk_parts(ledger: Ledger, chunk: ChunkSpec, repeats: int) -> tuple[dict[RolloutKey, bytes], list[str]]:
    """read_parts for `chunk` under the ledger's current run."""
    return read_parts(ledger.store, ledger.run_id, chunk.index, chunk.task_range, repeats)


def delete_parts(store: Store, chunk: int) -> None:
    store.delete_tree(part_dir(chunk))
