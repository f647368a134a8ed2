"""--parallelism above the open-files limit: the soft limit is raised as far as the hard one allows, and a
parallelism that cannot fit is refused before any request, naming the limit. Before, the run's own files
failed with EMFILE at 1,000+ in flight, and every chunk attempt lost all its replies."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import orjson
from cli_runs import run_args
from rollout_data import write_rows


def limited(soft: int, hard: int):
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return apply


def run(cli_env: dict[str, str], args: list[str], soft: int, hard: int) -> subprocess.CompletedProcess[str]:
    exe = str(Path(sys.executable).with_name("rollflow"))
    return subprocess.run(
        [exe, *args], env=cli_env, capture_output=True, text=True, timeout=300, preexec_fn=limited(soft, hard)
    )


def test_a_parallelism_past_the_soft_limit_raises_it(cli_env, fast_sim, tmp_path: Path) -> None:
    inp = write_rows(tmp_path / "rows.jsonl", 400)
    args = [a if a != "16" else "1200" for a in run_args(inp, str(tmp_path / "out"), fast_sim)]
    done = run(cli_env, args, soft=256, hard=4096)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "out" / "rollouts.jsonl").read_bytes().count(b"\n") == 800
    report = orjson.loads((tmp_path / "out" / "report.json").read_bytes())
    assert report["chunk_errors"] == [] and [e["errors"] for e in report["endpoints"]] == [0], report[
        "chunk_errors"
    ]


def test_a_parallelism_past_the_hard_limit_is_refused_naming_it(cli_env, fast_sim, tmp_path: Path) -> None:
    inp = write_rows(tmp_path / "rows.jsonl", 10)
    args = [a if a != "16" else "2000" for a in run_args(inp, str(tmp_path / "out"), fast_sim)]
    done = run(cli_env, args, soft=1024, hard=1500)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "--parallelism 2000 needs about 2256 open files" in done.stderr and "1500" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out" / "rollouts.jsonl").exists()
