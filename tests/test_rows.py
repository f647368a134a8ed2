"""Streaming input: each kind of bad row named by file and line, limits, chunk offsets, S3 input, memory."""

from __future__ import annotations

import hashlib
import tracemalloc
from pathlib import Path

import orjson
import pytest

from rollflow.tasks.collect.rows import MAX_BAD_TEXT, BadRow, InputError, iter_chunk_rows, scan_input
from rollflow.tasks.storage import rowjson


def good(i: int) -> bytes:
    return orjson.dumps(
        {"responses_create_params": {"input": [{"role": "user", "content": f"q{i}"}]}, "i": i}
    )


def all_rows(url: str, scan, storage_options: dict | None = None) -> list[tuple[int, int]]:
    return [(t, r["i"]) for c in scan.chunks for t, r in iter_chunk_rows(url, c, storage_options)]


BAD_KINDS = [
    (b'{"responses_create_params": {"inp', "not valid JSON"),
    (b"[1, 2]", "expected a JSON object, got list"),
    (b'"just a string"', "expected a JSON object, got str"),
    (b'{"prompt": "x"}', "no 'responses_create_params'"),
    (b'{"responses_create_params": null}', "no 'responses_create_params'"),
    (b'{"responses_create_params": [1]}', "'responses_create_params' must be an object, got list"),
    (b'{"responses_create_params": {"input": "\xff\xfe"}}', "not UTF-8"),
]


@pytest.mark.parametrize(("bad", "needle"), BAD_KINDS)
def test_each_bad_kind_names_file_and_line(tmp_path: Path, bad: bytes, needle: str) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(good(0) + b"\n\n" + good(1) + b"\n" + bad + b"\n" + good(3) + b"\n")
    with pytest.raises(InputError) as info:
        scan_input(str(inp), chunk_size=10, limit=None, skip_bad_rows=False)
    message = str(info.value)
    assert f"Input {inp}, line 4: " in message and needle in message
    assert "--skip-bad-rows" in message and "bad_rows.jsonl" in message
    scan = scan_input(str(inp), chunk_size=10, limit=None, skip_bad_rows=True)
    assert (scan.rows, scan.bad_rows, scan.tasks) == (3, 1, 4)


def test_skip_bad_rows_reports_each_and_keeps_indices(tmp_path: Path) -> None:
    lines = [good(0)] + [bad for bad, _ in BAD_KINDS] + [b"{" + b"x" * 5000, good(8)]
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"\n".join(lines) + b"\n")
    seen: list[BadRow] = []
    scan = scan_input(str(inp), chunk_size=3, limit=None, skip_bad_rows=True, on_bad_row=seen.append)
    assert [(b.line, b.task_index) for b in seen] == [(n, n - 1) for n in range(2, 10)]
    assert all(b.error for b in seen)
    assert len(seen[-1].text) == MAX_BAD_TEXT and seen[0].text == BAD_KINDS[0][0].decode()
    assert (scan.rows, scan.bad_rows, scan.tasks) == (2, 8, 10)
    assert [(c.first_task, c.num_tasks, c.good_rows) for c in scan.chunks] == [
        (0, 3, 1),
        (3, 3, 0),
        (6, 3, 0),
        (9, 1, 1),
    ]
    assert all_rows(str(inp), scan) == [(0, 0), (9, 8)]


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_empty_input(tmp_path: Path, content: bytes) -> None:
    inp = tmp_path / "empty.jsonl"
    inp.write_bytes(content)
    for skip in (False, True):
        with pytest.raises(InputError, match=rf"Input {inp} has no rows"):
            scan_input(str(inp), chunk_size=10, limit=None, skip_bad_rows=skip)


def test_only_bad_rows_is_an_error_even_when_skipping(tmp_path: Path) -> None:
    inp = tmp_path / "bad.jsonl"
    inp.write_bytes(b"[1]\n[2]\n")
    with pytest.raises(InputError, match=r"has no valid rows \(2 bad\)"):
        scan_input(str(inp), chunk_size=10, limit=None, skip_bad_rows=True)


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(InputError, match=rf"Input {missing} does not exist\. Check the path"):
        scan_input(str(missing), chunk_size=10, limit=None, skip_bad_rows=True)


def test_last_line_without_newline_and_crlf(tmp_path: Path) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(good(0) + b"\r\n" + good(1) + b"\r\n\r\n" + good(2))
    scan = scan_input(str(inp), chunk_size=2, limit=None, skip_bad_rows=False)
    assert (scan.rows, scan.tasks) == (3, 3)
    assert scan.fingerprint == hashlib.sha256(inp.read_bytes()).hexdigest()
    assert all_rows(str(inp), scan) == [(0, 0), (1, 1), (2, 2)]


def test_limit_counts_bad_rows_and_fingerprints_the_prefix(tmp_path: Path) -> None:
    lines = [good(0), b"[bad]", good(2), b"", good(3), good(4), good(5)]
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b"\n".join(lines) + b"\n")
    scan = scan_input(str(inp), chunk_size=2, limit=3, skip_bad_rows=True)
    assert (scan.rows, scan.bad_rows, scan.tasks) == (2, 1, 3)
    prefix = b"".join(line + b"\n" for line in lines[:3])  # up to and including the 3rd row
    assert scan.fingerprint == hashlib.sha256(prefix).hexdigest()
    assert all_rows(str(inp), scan) == [(0, 0), (2, 2)]
    # a bad row after the limit is never read
    inp.write_bytes(b"\n".join([good(0), good(1), b"[bad]"]) + b"\n")
    assert scan_input(str(inp), chunk_size=2, limit=2, skip_bad_rows=False).rows == 2
    # a limit beyond the file is the whole file
    assert scan_input(str(inp), chunk_size=2, limit=99, skip_bad_rows=True).tasks == 3


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1000])
def test_chunk_offsets_and_lines(tmp_path: Path, chunk_size: int) -> None:
    lines: list[bytes] = []
    for i in range(40):
        lines.append(good(i))
        if i % 5 == 0:
            lines.append(b"")
        if i % 11 == 0:
            lines.append(b"not json")
    inp = tmp_path / "in.jsonl"
    data = b"\n".join(lines)
    inp.write_bytes(data)
    scan = scan_input(str(inp), chunk_size=chunk_size, limit=None, skip_bad_rows=True)
    physical = data.split(b"\n")
    starts = [sum(len(x) + 1 for x in physical[:n]) for n in range(len(physical))]
    for c in scan.chunks:
        assert c.byte_offset == starts[c.first_line - 1] and physical[c.first_line - 1].strip()
    assert [c.index for c in scan.chunks] == list(range(len(scan.chunks)))
    assert sum(c.num_tasks for c in scan.chunks) == scan.tasks == 44
    assert sum(c.good_rows for c in scan.chunks) == scan.rows == 40
    got = all_rows(str(inp), scan)
    assert [r for _, r in got] == list(range(40))
    tasks = [t for t, _ in got]
    assert tasks == sorted(set(tasks)) and tasks[-1] == 43


def test_s3_input_matches_local(tmp_path: Path, moto_s3) -> None:
    data = b"".join(good(i) + b"\n" + (b"[bad]\n" if i % 97 == 0 else b"") for i in range(3000))
    local = tmp_path / "in.jsonl"
    local.write_bytes(data)
    bucket = moto_s3.new_bucket()
    moto_s3.fs().pipe_file(f"{bucket}/data/in.jsonl", data)
    url = f"s3://{bucket}/data/in.jsonl"
    a = scan_input(str(local), chunk_size=256, limit=None, skip_bad_rows=True)
    b = scan_input(url, chunk_size=256, limit=None, skip_bad_rows=True)
    assert (a.fingerprint, a.rows, a.bad_rows, a.chunks) == (b.fingerprint, b.rows, b.bad_rows, b.chunks)
    assert all_rows(url, b) == all_rows(str(local), a) and len(all_rows(url, b)) == 3000
    with pytest.raises(InputError, match=rf"Input s3://{bucket}/data/missing.jsonl does not exist"):
        scan_input(f"s3://{bucket}/data/missing.jsonl", chunk_size=10, limit=None, skip_bad_rows=False)


def test_scan_of_200k_rows_has_flat_memory(tmp_path: Path) -> None:
    inp = tmp_path / "big.jsonl"
    with inp.open("wb") as fh:
        for i in range(200_000):
            fh.write(good(i) + b"\n")
    size = inp.stat().st_size
    tracemalloc.start()
    try:
        scan = scan_input(str(inp), chunk_size=5000, limit=None, skip_bad_rows=False)
        _, scan_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        last = scan.chunks[-1]
        count = sum(1 for _ in iter_chunk_rows(str(inp), last))
        _, iter_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (scan.rows, len(scan.chunks), count) == (200_000, 40, 5000)
    assert scan_peak < size / 20, f"scan peaked at {scan_peak} bytes for a {size}-byte file"
    assert iter_peak < size / 20, f"reading one chunk peaked at {iter_peak} bytes"


CUT_OR_ODD = [
    (b'{"_ng_task_index": 3, "_ng_rollout_index": 0, "response": {"out', "not valid JSON"),
    (b'\xef\xbb\xbf{"_ng_task_index": 3, "_ng_rollout_index": 0}', "not valid JSON"),
    (b'{"_ng_task_index": 3, "_ng_rollout_index": 0, "t": "\xff"}', "not UTF-8"),
    (b'[{"_ng_task_index": 3}]', "expected a JSON object, got list"),
    (b'{"_ng_task_index": true, "_ng_rollout_index": 0}', "whole numbers"),
    (b'{"_ng_task_index": "3", "_ng_rollout_index": 0}', "whole numbers"),
    (b'{"_ng_task_index": 3, "_ng_rollout_index": -1}', "whole numbers"),
    (b'{"_ng_task_index": 3.0, "_ng_rollout_index": 0}', "whole numbers"),
    (b'{"_ng_rollout_index": 0}', "whole numbers"),
]


@pytest.mark.parametrize(("line", "needle"), CUT_OR_ODD)
def test_one_row_reader_refuses_each_odd_line_naming_file_and_line(line: bytes, needle: str) -> None:
    """Collection, the audit, Parquet, reverify's plan and its chunks read rows with this one reader."""
    with pytest.raises(rowjson.RowError) as caught:
        rowjson.read_keyed(line, "s3://b/out/rollouts.jsonl", 7)
    assert needle in caught.value.problem
    assert str(caught.value).startswith("s3://b/out/rollouts.jsonl, line 7: ")


def test_the_row_reader_keeps_exact_integers_and_the_key() -> None:
    line = (
        b'{"_ng_task_index": 2, "_ng_rollout_index": 1, "expected_answer": 1267650600228229401496703205376}'
    )
    row, key = rowjson.read_keyed(line)
    assert key == (2, 1) and row["expected_answer"] == 2**100
