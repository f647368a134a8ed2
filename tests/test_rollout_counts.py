"""Each rollout counted once: in collected, adopted, resumed or discarded, and in the progress count."""

from __future__ import annotations

import contextlib
import re
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from rollout_data import write_rows
from test_probe_accounting import SMALL_STEPS

from rollflow.infra.local import Service, spawn_simulator

PROGRESS = re.compile(r"collect ([\d,]+)/([\d,]+) rollouts \((\d+)%\).*?(?:ETA (-?[\d,]+) s)?$", re.M)


def _run(run_cli, sim: Service, inp: Path, out: Path, *extra: str, env: dict[str, str] | None = None):
    res = run_cli(
        "run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent",
        "--backend-url", sim.url, *extra, env=env,
    )  # fmt: skip
    assert res.returncode in (0, 1), res.stderr
    return res, orjson.loads((out / "report.json").read_bytes())


def _progress(stderr: str) -> list[tuple[int, int, int, int | None]]:
    """(finished, total, percent, ETA seconds) of every plain progress line."""
    lines = [
        (
            int(a.replace(",", "")),
            int(b.replace(",", "")),
            int(pct),
            None if eta == "" else int(eta.replace(",", "")),
        )
        for a, b, pct, eta in PROGRESS.findall(stderr)
    ]
    assert lines, f"no progress line: {stderr[-2000:]}"
    return lines


def _assert_progress_once(stderr: str, planned: int) -> None:
    lines = _progress(stderr)
    assert all(total == planned for _, total, _, _ in lines), lines
    assert all(done <= total and pct <= 100 for done, total, pct, _ in lines), lines
    assert all(eta is None or eta >= 0 for *_, eta in lines), lines


def test_discarded_probes_are_not_hidden_by_a_resumed_commit(run_cli, tmp_path: Path):
    """Rows of a partly failed commit are resumed, not adopted probes, so failed probes stay discarded."""
    sim = spawn_simulator("--latency-ms", "2", "--slots", "64", "--fault-rate", "0.2", "--fault-kinds", "500")
    try:
        inp, out = write_rows(tmp_path / "rows.jsonl", 400), tmp_path / "out"
        env = {**SMALL_STEPS, "ROLLFLOW_BACKEND__MAX_RETRIES": "0", "ROLLFLOW_TUNING__MAX_ERROR_RATE": "0.6"}
        args = ("--chunk-size", "100", "--no-progress")
        _, first = _run(run_cli, sim, inp, out, *args, "--parallelism", "16", env=env)
        assert first["failed"] > 0 and first["rows_written"] > 0, first
        _, report = _run(run_cli, sim, inp, out, *args, env=env)
    finally:
        sim.stop()
    tuning, m = report["tuning"], report["metrics"]
    failed_probes = sum(step["errors"] for step in tuning["steps"])
    assert failed_probes > 0, tuning["steps"]
    assert m["resumed"] == first["rows_written"], m
    assert tuning["discarded"] == failed_probes, tuning
    assert tuning["adopted"] == m["adopted"] == tuning["total_probe_rollouts"] - failed_probes
    assert m["collected"] + m["adopted"] + m["resumed"] == report["rows_written"], m


def _heal_after_first_stall(sim: Service, out: Path) -> None:
    """Once the stalled attempt saved its rollouts, stop the hangs so the retry can finish the chunk."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list((out / "parts" / "00000").glob("flush-*")):
        time.sleep(0.05)
    body = orjson.dumps({"fault_rate": 0.0})
    urllib.request.urlopen(urllib.request.Request(f"{sim.url}/admin/config", data=body), timeout=5).read()


def test_a_stalled_attempts_saved_rollouts_count_as_collected(run_cli, tmp_path: Path):
    """A retried chunk adopts what its stalled attempt saved: requested by this run, so collected."""
    sim = spawn_simulator(
        "--latency-ms", "1", "--slots", "64", "--fault-rate", "0.1", "--fault-kinds", "hang", "--seed", "7"
    )
    try:
        inp, out = write_rows(tmp_path / "rows.jsonl", 40), tmp_path / "out"
        healer = threading.Thread(target=_heal_after_first_stall, args=(sim, out), daemon=True)
        healer.start()
        res, report = _run(
            run_cli, sim, inp, out, "--parallelism", "1", "--chunk-size", "40", "--timeout-s", "100",
            "--stall-timeout-s", "1", "--flush-interval-s", "0",
        )  # fmt: skip
        healer.join(5)
    finally:
        sim.stop()
    assert res.returncode == 0, res.stderr
    manifest = orjson.loads((out / "chunks" / "00000.json").read_bytes())
    assert manifest["attempt"] > 1, "the chunk never stalled"
    m = report["metrics"]
    assert manifest["stats"]["adopted"] == m["adopted"] == 0, manifest["stats"]
    assert m["collected"] == report["rows_written"] == 40, m
    _assert_progress_once(res.stderr, 40)


@contextlib.contextmanager
def _undeletable(path: Path) -> Iterator[None]:
    """An immutable file (root) in `path`: removing the directory fails until it is released."""
    path.mkdir(parents=True)
    pinned = path / "pinned.jsonl"
    pinned.write_bytes(b"not a part\n")
    if subprocess.run(["chattr", "+i", str(pinned)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (needs root on ext4 or similar)")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(pinned)], check=True)


def test_a_commit_whose_parts_cannot_be_deleted_counts_as_committed(run_cli, fast_sim: Service, tmp_path):
    inp, out = write_rows(tmp_path / "rows.jsonl", 200), tmp_path / "out"
    with _undeletable(out / "parts" / "00000"):
        res, report = _run(
            run_cli, fast_sim, inp, out, "--parallelism", "16", "--chunk-size", "100", "--no-progress"
        )
        assert (out / "parts" / "00000" / "pinned.jsonl").exists()
    assert res.returncode == 0, res.stderr
    m = report["metrics"]
    assert m["chunks_run"] == 2 and m["chunks_skipped"] == 0, m
    assert m["collected"] == report["rows_written"] == 200, m
    assert not report["chunk_errors"], report["chunk_errors"]
    assert any("00000" in note and "could not be deleted" in note for note in report["parts_not_deleted"])


def test_progress_counts_adopted_probes_once(run_cli, fast_sim: Service, tmp_path: Path):
    """Probe rollouts count when their chunk adopts them, not also when tuning ran them."""
    inp, out = write_rows(tmp_path / "rows.jsonl", 400), tmp_path / "out"
    res, report = _run(run_cli, fast_sim, inp, out, "--chunk-size", "100", env=SMALL_STEPS)
    assert res.returncode == 0, res.stderr
    assert report["tuning"]["adopted"] > 0, report["tuning"]
    _assert_progress_once(res.stderr, 400)
    assert _progress(res.stderr)[-1][:3] == (400, 400, 100)
