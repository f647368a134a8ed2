"""Streaming input scan: chunk offsets, limit, fingerprint, bad rows, constant memory."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import orjson
import pytest

from rollflow.tasks.collect.rows import BadRow, InputError, iter_chunk_rows, scan_input


def row(i: int) -> bytes:
    return orjson.dumps({"responses_create_params": {"input": f"q{i}"}, "i": i}) + b"\n"


def test_chunks_cover_every_row_in_order(tmp_path: Path) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"".join(row(i) + (b"\n" if i % 7 == 0 else b"") for i in range(103)).rstrip(b"\n"))
    scan = scan_input(str(inp), chunk_size=10, limit=None, skip_bad_rows=False)
    assert (scan.rows, scan.tasks, len(scan.chunks)) == (103, 103, 11)
    got = [(t, r["i"]) for c in scan.chunks for t, r in iter_chunk_rows(str(inp), c)]
    assert got == [(i, i) for i in range(103)]


def test_limit_changes_fingerprint_and_stops(tmp_path: Path) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"".join(row(i) for i in range(50)))
    full = scan_input(str(inp), chunk_size=8, limit=None, skip_bad_rows=False)
    part = scan_input(str(inp), chunk_size=8, limit=20, skip_bad_rows=False)
    assert part.rows == 20 and part.fingerprint != full.fingerprint
    assert sum(c.num_tasks for c in part.chunks) == 20
    assert [t for c in part.chunks for t, _ in iter_chunk_rows(str(inp), c)] == list(range(20))


def test_bad_rows_skipped_keep_their_task_index(tmp_path: Path) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(row(0) + b"{broken\n" + row(2) + b'{"no": "params"}\n' + row(4))
    with pytest.raises(InputError, match=r"line 2: the line is not valid JSON"):
        scan_input(str(inp), chunk_size=2, limit=None, skip_bad_rows=False)
    bad: list[BadRow] = []
    scan = scan_input(str(inp), chunk_size=2, limit=None, skip_bad_rows=True, on_bad_row=bad.append)
    assert [(b.line, b.task_index) for b in bad] == [(2, 1), (4, 3)]
    assert (scan.rows, scan.bad_rows, scan.tasks) == (3, 2, 5)
    assert [c.good_rows for c in scan.chunks] == [1, 1, 1]
    assert [t for c in scan.chunks for t, _ in iter_chunk_rows(str(inp), c)] == [0, 2, 4]


def test_scan_memory_is_flat(tmp_path: Path) -> None:
    inp = tmp_path / "big.jsonl"
    with inp.open("wb") as fh:
        for i in range(200_000):
            fh.write(row(i))
    size = inp.stat().st_size
    tracemalloc.start()
    scan = scan_input(str(inp), chunk_size=1000, limit=None, skip_bad_rows=False)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert scan.rows == 200_000
    assert peak < size / 5, f"scan peaked at {peak} bytes for a {size}-byte file"
