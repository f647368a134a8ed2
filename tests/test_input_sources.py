"""Inputs that cannot seek: a gzip-compressed file, and an HTTP server that ignores Range requests."""

from __future__ import annotations

import gzip
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from rollout_data import assert_complete, write_rows
from test_errors import args_for, one_paragraph

from rollflow.infra.local import free_port, wait_http

ROWS = 90  # chunks of 50 tasks: the second chunk starts past byte 0


def test_gzip_input_is_read_and_chunked(run_cli, fast_sim, tmp_path: Path):
    plain = write_rows(tmp_path / "rows.jsonl", ROWS)
    packed = tmp_path / "rows.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    res = run_cli(*args_for(packed, tmp_path / "out", fast_sim.url, "--num-repeats", "2"))
    assert res.returncode == 0, res.stderr
    assert_complete((tmp_path / "out" / "rollouts.jsonl").read_bytes().splitlines(), ROWS, 2)
    # compressed under a name that does not say so: said plainly, not as "line 1 is not UTF-8"
    hidden = tmp_path / "hidden.jsonl"
    hidden.write_bytes(packed.read_bytes())
    res = run_cli(*args_for(hidden, tmp_path / "out2", fast_sim.url))
    assert res.returncode == 2, res.stderr
    assert "is gzip-compressed but its name does not say so" in one_paragraph(res.stderr)


@pytest.fixture
def plain_http_server(tmp_path: Path):
    """`python -m http.server` over tmp_path: it answers every GET whole, Range or not."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/", 30, proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def test_http_input_without_range_requests(run_cli, fast_sim, plain_http_server: str, tmp_path: Path):
    write_rows(tmp_path / "rows.jsonl", ROWS)
    url = f"{plain_http_server}/rows.jsonl"
    ranged = urllib.request.Request(url, headers={"Range": "bytes=10-19"})
    with urllib.request.urlopen(ranged, timeout=10) as reply:
        assert reply.status == 200, "the server must ignore Range for this test to mean anything"
    res = run_cli(*args_for(url, tmp_path / "out", fast_sim.url, "--num-repeats", "2"), timeout=180)
    assert res.returncode == 0, res.stderr
    assert_complete((tmp_path / "out" / "rollouts.jsonl").read_bytes().splitlines(), ROWS, 2)
