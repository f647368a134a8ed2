"""Per-worker figures of a Dask run: a chunk retried after a stall is counted once in its worker's
`rollouts` (its adopted rollouts were counted when they were collected)."""

from __future__ import annotations

from pathlib import Path

import orjson
from rollout_data import assert_complete, write_rows

from rollflow.infra.local import spawn_simulator

ROWS, REPEATS = 40, 2


def test_a_retried_chunk_is_counted_once_in_its_workers_rollouts(run_cli, tmp_path: Path):
    # One request in flight: a hung request stalls its chunk, which is cancelled (its finished rollouts
    # saved) and retried; the retry adopts them.
    sim = spawn_simulator(
        "--latency-ms", "2", "--fault-rate", "0.03", "--fault-kinds", "hang", "--hang-s", "5"
    )
    inp = write_rows(tmp_path / "rows.jsonl", ROWS)
    out = tmp_path / "out"
    try:
        res = run_cli(
            "run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent",
            "--backend-url", sim.url, "--num-repeats", str(REPEATS), "--parallelism", "1",
            "--chunk-size", "20", "--stall-timeout-s", "1", "--runner", "dask", "--dask-workers", "1",
            "--no-progress", timeout=240,
        )  # fmt: skip
    finally:
        sim.stop()
    assert res.returncode == 0, res.stderr[-3000:]
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), ROWS, REPEATS)
    attempts = [orjson.loads(m.read_bytes())["attempt"] for m in (out / "chunks").glob("*.json")]
    assert max(attempts) >= 2, f"no chunk was retried, so this run shows nothing: {attempts}"
    report = orjson.loads((out / "report.json").read_bytes())
    assert sum(w["rollouts"] for w in report["workers"]) == ROWS * REPEATS, report["workers"]
    assert report["share_book_errors"] == []
