"""Part objects: finished rollouts of a chunk saved before the chunk commits (probes and flushes).

A part is written whole, like every object, under parts/<chunk>/<name>.jsonl. Its first line is a header
naming the run (run_id) and chunk it was written for, and its origin: "probe" (tuning, with the session of
the command that probed, so the report can tell its own probes) or "flush" (a chunk attempt). When the
chunk runs it adopts the rollouts of its own run's parts instead of asking the backend again, and once
the chunk commits its parts are deleted.
A part of another run, of another chunk, or one that cannot be read is ignored and reported: its
rollouts are simply collected again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import orjson

from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.storage import rowjson
from rollflow.tasks.storage.ledger import Ledger
from rollflow.tasks.storage.rowjson import RolloutKey
from rollflow.tasks.storage.store import Store

PARTS_DIR = "parts"
HEADER_KEY = "_rf_part"

PROBE, FLUSH = "probe", "flush"


@dataclass
class PartRollouts:
    """This run's saved rollouts of a chunk, and which of them probes saved (by probing session)."""

    kept: dict[RolloutKey, bytes] = field(default_factory=dict)
    probes: dict[RolloutKey, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def part_dir(chunk: int) -> str:
    return f"{PARTS_DIR}/{chunk:05d}"


def part_header(run_id: str, chunk: int, origin: str = FLUSH, session: str = "") -> bytes:
    header = {"run_id": run_id, "chunk": chunk, "origin": origin, "session": session}
    return orjson.dumps({HEADER_KEY: header})


def write_part(
    store: Store,
    run_id: str,
    chunk: int,
    name: str,
    lines: Sequence[bytes],
    origin: str = FLUSH,
    session: str = "",
) -> None:
    if lines:
        head = part_header(run_id, chunk, origin, session)
        body = b"".join(line + b"\n" for line in (head, *lines))
        store.write_bytes(f"{part_dir(chunk)}/{name}.jsonl", body)


def _parse_part(
    data: bytes, run_id: str, chunk: int, keys: range, repeats: int
) -> tuple[dict[str, object], dict[RolloutKey, bytes]]:
    """The header and rollouts of one part; ValueError says why the part cannot be adopted."""
    lines = data.splitlines()
    header = orjson.loads(lines[0]).get(HEADER_KEY) if lines else None
    if not isinstance(header, dict):
        raise ValueError("it has no run header")
    if header.get("run_id") != run_id or header.get("chunk") != chunk:
        raise ValueError(f"it belongs to run {header.get('run_id')!r}, chunk {header.get('chunk')!r}")
    found: dict[RolloutKey, bytes] = {}
    for lineno, line in enumerate(lines[1:], start=2):
        if line.strip():
            _, key = rowjson.read_keyed(line, None, lineno)
            if key[0] not in keys or not 0 <= key[1] < repeats:
                raise ValueError(f"it holds {key}, outside this chunk")
            found[key] = line
    return header, found


def read_part_rollouts(store: Store, run_id: str, chunk: int, keys: range, repeats: int) -> PartRollouts:
    """This run's saved rollouts of `chunk` (tasks in `keys`), their origin, a note per ignored part."""
    parts, flushed = PartRollouts(), set[RolloutKey]()
    for name in store.list(part_dir(chunk)):
        rel = f"{part_dir(chunk)}/{name}"
        try:
            header, found = _parse_part(store.read_bytes(rel), run_id, chunk, keys, repeats)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError, OSError) as exc:
            parts.problems.append(f"part {rel} is unreadable or foreign ({exc}); its rollouts are redone")
            continue
        parts.kept.update(found)
        if header.get("origin") == PROBE:
            parts.probes.update(dict.fromkeys(found, str(header.get("session") or "")))
        else:
            flushed.update(found)
    for key in flushed:  # a chunk attempt requested it again: collected, not adopted
        parts.probes.pop(key, None)
    return parts


def chunk_part_rollouts(ledger: Ledger, chunk: ChunkSpec, repeats: int) -> PartRollouts:
    """read_part_rollouts for `chunk` under the ledger's current run."""
    return read_part_rollouts(ledger.store, ledger.run_id, chunk.index, chunk.task_range, repeats)


def delete_parts(store: Store, chunk: int) -> None:
    store.delete_tree(part_dir(chunk))
