"""Kill -9 at several points, resume, and get the byte-identical dataset; faults never lose a row."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import orjson
from cli_runs import ROWS, run_args, spawn, wait_until
from rollout_data import assert_complete

from rollflow.infra.local import spawn_simulator


def manifests(out: Path) -> int:
    chunks = out / "chunks"
    return len(list(chunks.glob("*.json"))) if chunks.exists() else 0


def test_kill9_at_several_points_local(run_cli, cli_env, slow_sim, rows_input, reference, tmp_path):
    out = tmp_path / "out"
    args = run_args(rows_input, str(out), slow_sim)
    killed_at: list[int] = []
    for target in (0, 3, 12, 25):
        proc = spawn(args, cli_env)
        if target == 0:
            wait_until(lambda: (out / "run.json").exists(), proc)
        else:
            wait_until(lambda t=target: manifests(out) >= t, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        killed_at.append(manifests(out))
    assert killed_at == sorted(killed_at) and killed_at[-1] < 60, killed_at
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    assert (out / "rollouts.jsonl").read_bytes() == reference
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["metrics"]["chunks_skipped"] >= killed_at[-1] - 1


def test_kill9_during_commit_s3(run_cli, cli_env, slow_sim, rows_input, reference, moto_s3):
    """Freeze the S3 server so the next chunk commit is stuck mid-PUT, kill -9 rollflow, resume."""
    bucket = moto_s3.new_bucket()
    out = f"s3://{bucket}/run"
    env = {**cli_env, **moto_s3.env}
    args = run_args(rows_input, out, slow_sim)
    fs = moto_s3.fs()

    def committed() -> int:
        try:
            return sum(1 for p in fs.ls(f"{out}/chunks", refresh=True) if p.endswith(".json"))
        except FileNotFoundError:
            return 0

    proc = spawn(args, env)
    wait_until(lambda: committed() >= 3, proc)
    moto = moto_s3.service.proc
    moto.send_signal(signal.SIGSTOP)
    try:
        time.sleep(1.0)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        moto.send_signal(signal.SIGCONT)
    res = run_cli(*args, env=moto_s3.env)
    assert res.returncode == 0, res.stderr
    fs.invalidate_cache()
    assert fs.cat_file(f"{out}/rollouts.jsonl") == reference


def test_faults_and_hangs_every_row_once(run_cli, rows_input, tmp_path):
    sim = spawn_simulator(
        "--latency-ms", "5", "--slots", "64", "--fault-rate", "0.1",
        "--fault-kinds", "429,500,503,reset,malformed,hang", "--retry-after-s", "0.2", "--hang-s", "60",
    )  # fmt: skip
    try:
        out = tmp_path / "out"
        res = run_cli(
            "run", "--input", str(rows_input), "--output", str(out), "--limit", "600",
            "--backend-kind", "responses", "--backend-url", sim.url, "--num-repeats", "2",
            "--parallelism", "64", "--timeout-s", "1", "--max-retries", "12", "--verifier", "math",
            "--no-progress",
            env={"ROLLFLOW_BACKEND__BACKOFF_BASE_S": "0.05", "ROLLFLOW_BACKEND__BACKOFF_MAX_S": "0.5"},
            timeout=240,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        assert_complete((out / "rollouts.jsonl").read_bytes().splitlines(), 600, 2)
        report = orjson.loads((out / "report.json").read_bytes())
        assert report["failed"] == 0 and report["metrics"]["retries"] > 50
        import urllib.request

        faults = orjson.loads(urllib.request.urlopen(f"{sim.url}/stats").read())["faults"]
        assert faults.get("hang", 0) > 0 and faults.get("reset", 0) > 0
    finally:
        sim.stop()


def test_row_level_resume_redoes_little(run_cli, cli_env, rows_input, reference, tmp_path):
    """One big chunk killed mid-way: its flushed parts are adopted, so only the unsaved tail is redone."""
    import urllib.request

    sim = spawn_simulator("--latency-ms", "20", "--slots", "16")
    out = tmp_path / "out"
    args = [*run_args(rows_input, str(out), sim), "--chunk-size", "2000"]
    env = {**cli_env, "ROLLFLOW_COLLECTION__FLUSH_INTERVAL_S": "0.5"}

    def metrics() -> dict:
        return orjson.loads(urllib.request.urlopen(f"{sim.url}/stats").read())

    def parts() -> list[Path]:
        return sorted((out / "parts").glob("*/*.jsonl")) if (out / "parts").exists() else []

    try:
        proc = spawn(args, env)
        wait_until(lambda: len(parts()) >= 3, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        done_before_kill = metrics()["completed"]
        saved = {
            (row["_ng_task_index"], row["_ng_rollout_index"])
            for part in parts()
            for row in map(orjson.loads, part.read_bytes().splitlines()[1:])  # after the run header
        }
        assert not (out / "chunks").exists() or not list((out / "chunks").glob("*.json"))
        redone_bound = 16 + 0.5 * 800 + 100  # in flight + one flush interval at 800/s + scheduling slack
        assert 0 < done_before_kill - len(saved) <= redone_bound, (done_before_kill, len(saved))
        urllib.request.urlopen(urllib.request.Request(f"{sim.url}/stats/reset", method="POST")).read()
        res = run_cli(*args, env={"ROLLFLOW_COLLECTION__FLUSH_INTERVAL_S": "0.5"})
        assert res.returncode == 0, res.stderr
        assert metrics()["requests"] == ROWS * 2 - len(saved), "adopted rollouts must not be requested again"
        assert (out / "rollouts.jsonl").read_bytes() == reference
        assert not list((out / "parts").glob("*/*")), "a committed chunk's parts are removed"
    finally:
        sim.stop()


def test_deadline_stops_cleanly_then_resumes(run_cli, slow_sim, rows_input, reference, tmp_path):
    out = tmp_path / "out"
    args = run_args(rows_input, str(out), slow_sim)
    res = run_cli(*args, "--deadline-s", "2.5")
    assert res.returncode == 1, res.stderr
    assert "stopped at its deadline" in res.stderr and "run the same command again" in res.stderr.lower()
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["stopped_at_deadline"] and not report["published"]
    assert 0 < report["rows_written"] < ROWS * 2
    assert not (out / "rollouts.jsonl").exists()
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    assert (out / "rollouts.jsonl").read_bytes() == reference


def test_stalled_chunk_is_cancelled_and_reported(run_cli, rows_input, tmp_path):
    sim = spawn_simulator(
        "--latency-ms", "1", "--fault-rate", "1", "--fault-kinds", "hang", "--hang-s", "120"
    )
    try:
        out = tmp_path / "out"
        t0 = time.monotonic()
        res = run_cli(
            "run", "--input", str(rows_input), "--output", str(out), "--limit", "20", "--parallelism", "8",
            "--backend-kind", "agent",
            "--backend-url", sim.url, "--timeout-s", "100", "--stall-timeout-s", "1", "--no-progress",
            env={"ROLLFLOW_COLLECTION__CHUNK_RETRIES": "1"},
            timeout=120,
        )  # fmt: skip
        assert res.returncode == 1, res.stderr
        assert time.monotonic() - t0 < 60, "a stalled chunk must not wait for the request timeout"
        assert "ChunkStalled" in res.stderr and "no rollout finished for 1s" in res.stderr
        report = orjson.loads((out / "report.json").read_bytes())
        assert report["chunk_errors"] and report["missing"] == 20
    finally:
        sim.stop()


def test_corrupt_part_and_half_written_object_are_survived(
    run_cli, slow_sim, rows_input, reference, tmp_path
):
    out = tmp_path / "out"
    args = run_args(rows_input, str(out), slow_sim)
    assert run_cli(*args, "--deadline-s", "2.5").returncode == 1
    committed = {int(p.stem) for p in out.glob("chunks/*.json")}
    pending = min(set(range(len(committed) + 1)) - committed)
    bad_part = out / "parts" / f"{pending:05d}" / "flush-bad-00000.jsonl"
    bad_part.parent.mkdir(parents=True, exist_ok=True)
    bad_part.write_bytes(b'{"_ng_task_index": 1, "_ng_rollout_inde')
    (out / "chunks" / f"{pending + 1:05d}.jsonl.tmp-999-dead").write_bytes(b'{"half": ')
    (out / "chunks" / f"{pending + 2:05d}.jsonl").write_bytes(b"a data object whose manifest never landed\n")
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr
    assert (out / "rollouts.jsonl").read_bytes() == reference
    report = orjson.loads((out / "report.json").read_bytes())
    assert any("unreadable" in note and "redone" in note for note in report["ignored_parts"])
