"""Verifiers in a process pool: a check that hangs or kills its process costs that rollout alone, as a
failure with its reason (never a reward), and the next run redoes only those rollouts."""

from __future__ import annotations

import os
from pathlib import Path

import orjson
from key_server import EchoServer

BAD_VERIFIER = """
import os, time

def score(row, text):
    if os.path.exists(row["flag"]):
        if row["n"] == 3:
            time.sleep(3600)
        if row["n"] == 5:
            os._exit(3)
    return 1.0
"""


def test_a_hung_or_crashed_check_fails_its_rollout_alone_and_is_redone_next_run(run_cli, tmp_path: Path):
    (tmp_path / "bad_verifier.py").write_text(BAD_VERIFIER)
    flag = tmp_path / "misbehave"
    flag.touch()
    inp = tmp_path / "in.jsonl"
    rows = (
        {"responses_create_params": {"input": f"answer {n}"}, "n": n, "flag": str(flag)} for n in range(20)
    )
    inp.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    out = tmp_path / "out"
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    with EchoServer() as server:
        args = [
            "run", "--input", str(inp), "--output", str(out), "--backend-kind", "responses",
            "--backend-url", server.url, "--verifier", "bad_verifier:score", "--parallelism", "4",
            "--verify-processes", "2", "--verify-timeout-s", "2", "--no-progress",
        ]  # fmt: skip
        res = run_cli(*args, env=env)
        assert res.returncode == 1, res.stderr
        failures = {
            row["_ng_task_index"]: row["error"]
            for row in map(orjson.loads, (out / "failures" / "00000.jsonl").read_bytes().splitlines())
        }
        assert {n: e["kind"] for n, e in failures.items()} == {3: "verifier_timeout", 5: "verifier_crash"}
        assert "--verify-timeout-s 2s" in failures[3]["message"] and "exit 3" in failures[5]["message"]
        manifest = orjson.loads((out / "chunks" / "00000.json").read_bytes())
        assert manifest["rows"] == 18 and manifest["failed"] == 2
        flag.unlink()
        first = len(server.server.seen)
        res = run_cli(*args, env=env)
        assert res.returncode == 0, res.stderr
        assert len(server.server.seen) - first == 2, "the next run requests only the two failed rollouts"
    published = [orjson.loads(line) for line in (out / "rollouts.jsonl").read_bytes().splitlines()]
    assert [row["n"] for row in published] == list(range(20)) and {row["reward"] for row in published} == {
        1.0
    }


async def test_warming_stops_waiting_once_a_process_cannot_start() -> None:
    """A verifier whose processes cannot import it: warming the pool returns when the first start fails,
    not after the whole start timeout (90 s here), so a diagnosis begins at once and the checks fail
    with their reason."""
    import time

    from rollflow.tasks.verify.pool import VerifyPool

    pool = VerifyPool("no_such_module_for_rollflow:score", 2, 5.0, start_timeout_s=90.0)
    try:
        t0 = time.monotonic()
        waited = await pool.warm()
        assert waited < 45.0 and time.monotonic() - t0 < 45.0, waited  # a failed start takes seconds
        assert pool.start_failures >= 1
    finally:
        pool.close()
