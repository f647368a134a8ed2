"""A share book round that fails (the scheduler's metadata unreadable for a moment) is the run's
`share_book_errors`, not a chunk's error: the run completes and its chunks keep their shares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
from rollout_data import assert_complete, write_rows

ROWS, REPEATS = 40, 2

# The real Dask channel, whose second read of the workers' reports fails once, then the CLI's run.
ONE_ROUND_FAILS = """
import sys
from rollflow.flows import engines
from rollflow.flows.cli.main import main
from rollflow.tasks.scaleout.channels import DaskChannel


class OneRoundFails(DaskChannel):
    reads = 0

    def reports(self):
        OneRoundFails.reads += 1
        if OneRoundFails.reads == 2:
            raise ConnectionError("scheduler metadata unreachable for one round")
        return super().reports()


engines.DaskChannel = OneRoundFails
code = main(sys.argv[1:])
print("reports read", OneRoundFails.reads, file=sys.stderr)
sys.exit(code)
"""


def test_a_failed_share_book_round_is_no_chunk_error(cli_env, fast_sim, tmp_path: Path):
    inp = write_rows(tmp_path / "rows.jsonl", ROWS)
    out = tmp_path / "out"
    args = [
        "run", "--input", str(inp), "--output", str(out), "--backend-kind", "agent",
        "--backend-url", fast_sim.url, "--num-repeats", str(REPEATS), "--parallelism", "4",
        "--chunk-size", "20", "--runner", "dask", "--dask-workers", "1", "--no-progress",
    ]  # fmt: skip
    res = subprocess.run(
        [sys.executable, "-c", ONE_ROUND_FAILS, *args],
        env=cli_env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), ROWS, REPEATS)
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["share_book_errors"] == [
        "share book round failed: ConnectionError: scheduler metadata unreachable for one round"
    ]
    assert report["chunk_errors"] == [] and report["failed"] == 0
