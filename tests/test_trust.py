"""A published dataset holds only this run's rollouts, each with its own row's reward (end to end)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import orjson
import pytest
from cli_runs import ROWS, run_args, spawn, wait_until

from rollflow.infra.local import spawn_simulator

ROW_REWARD = "def score(row, text):\n    return float(row['target'])\n"


def test_a_row_verifier_never_gets_another_rows_reward(run_cli, fast_sim, tmp_path):
    """Every answer has the same text; the callable scores by a per-row field, so each reward differs."""
    (tmp_path / "row_reward.py").write_text(ROW_REWARD)
    inp = tmp_path / "in.jsonl"
    with inp.open("wb") as fh:
        for i in range(200):
            row = {"responses_create_params": {"input": "Say hello."}, "target": (i % 7) / 6}
            fh.write(orjson.dumps(row) + b"\n")
    out = tmp_path / "out"
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    res = run_cli(
        "run", "--input", str(inp), "--output", str(out), "--backend-kind", "responses",
        "--backend-url", fast_sim.url, "--parallelism", "16", "--verifier", "row_reward:score",
        "--no-progress", env={"PYTHONPATH": path},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    rows = [orjson.loads(line) for line in (out / "rollouts.jsonl").read_bytes().splitlines()]
    assert len({row["response"]["output"][0]["content"][0]["text"] for row in rows}) == 1
    wrong = [row["_ng_task_index"] for row in rows if row["reward"] != row["target"]]
    assert not wrong, f"{len(wrong)} rows carry another row's reward"


def _s3_parts(fs, out: str) -> list[str]:
    try:
        return [p for p in fs.find(f"{out}/parts") if p.endswith(".jsonl")]
    except FileNotFoundError:
        return []


def test_restart_on_s3_keeps_nothing_of_the_discarded_run(run_cli, cli_env, moto_s3, rows_input, tmp_path):
    """Run 1 (backend A) is killed after flushing parts; run 2 --restart (backend B) publishes B only.

    A part of run 1 planted into a fresh output is ignored and reported, never adopted.
    """
    sim_a = spawn_simulator("--latency-ms", "20", "--slots", "8", "--seed", "1")
    sim_b = spawn_simulator("--latency-ms", "2", "--slots", "64", "--seed", "2")
    try:
        args = ["--chunk-size", "2000", "--limit", "300"]
        ref = tmp_path / "ref"
        assert run_cli(*run_args(rows_input, str(ref), sim_b), *args).returncode == 0
        reference = (ref / "rollouts.jsonl").read_bytes()
        out, fs = f"s3://{moto_s3.new_bucket()}/run", moto_s3.fs()
        env = {**cli_env, **moto_s3.env, "ROLLFLOW_COLLECTION__FLUSH_INTERVAL_S": "0.2"}
        proc = spawn([*run_args(rows_input, out, sim_a), *args], env)
        wait_until(lambda: len(_s3_parts(fs, out)) >= 2, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        old_part = fs.cat_file(_s3_parts(fs, out)[0])
        res = run_cli(*run_args(rows_input, out, sim_b), *args, "--restart", env=moto_s3.env)
        assert res.returncode == 0, res.stderr
        fs.invalidate_cache()
        assert fs.cat_file(f"{out}/rollouts.jsonl") == reference

        fresh = tmp_path / "fresh"
        (fresh / "parts" / "00000").mkdir(parents=True)
        (fresh / "parts" / "00000" / "flush-old.jsonl").write_bytes(old_part)
        res = run_cli(*run_args(rows_input, str(fresh), sim_b), *args)
        assert res.returncode == 0, res.stderr
        assert (fresh / "rollouts.jsonl").read_bytes() == reference
        report = orjson.loads((fresh / "report.json").read_bytes())
        assert any("flush-old" in note and "redone" in note for note in report["ignored_parts"])
    finally:
        sim_a.stop()
        sim_b.stop()


def _tamper(path: Path, keep_mtime: bool) -> None:
    """Flip one reward without changing the object's size (and, if asked, its mtime)."""
    st = path.stat()
    data = path.read_bytes()
    flipped = data.replace(b'"reward":1.0', b'"reward":0.0', 1)
    if flipped == data:
        flipped = data.replace(b'"reward":0.0', b'"reward":1.0', 1)
    assert flipped != data and len(flipped) == len(data)
    path.write_bytes(flipped)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_chunk_changed_after_commit_is_never_published(run_cli, slow_sim, rows_input, reference, tmp_path):
    """Changed after its audit was cached: refused (by the audit, or by the copy's own hash), withdrawn,
    and the next run collects it again."""
    out = tmp_path / "out"
    args = [*run_args(rows_input, str(out), slow_sim), "--keep-chunks"]
    assert run_cli(*args).returncode == 0
    for chunk, keep_mtime in ((3, False), (7, True)):
        _tamper(out / "chunks" / f"{chunk:05d}.jsonl", keep_mtime)
        res = run_cli(*args)
        assert res.returncode != 0, "a changed chunk was published"
        assert f"chunk {chunk}" in res.stderr, res.stderr
        assert (out / "rollouts.jsonl").read_bytes() == reference
        assert not (out / "chunks" / f"{chunk:05d}.json").exists(), "the commit must be withdrawn"
        res = run_cli(*args)
        assert res.returncode == 0, res.stderr
        assert (out / "rollouts.jsonl").read_bytes() == reference


def test_a_published_dataset_changed_in_place_is_never_republished(
    run_cli, slow_sim, rows_input, reference, tmp_path
):
    """Once published, a chunk's bytes are read from the dataset: a reward flipped there (same size, so the
    spans still point into it) is refused by the copy's own hash, withdrawn, and collected again."""
    out = tmp_path / "out"
    args = run_args(rows_input, str(out), slow_sim)
    assert run_cli(*args).returncode == 0
    assert not list((out / "chunks").glob("*.jsonl"))
    _tamper(out / "rollouts.jsonl", keep_mtime=True)
    res = run_cli(*args)
    assert res.returncode != 0 and "chunk 0" in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "rollouts.jsonl").read_bytes() == reference


def test_a_manifest_without_its_data_object_is_withdrawn_and_collected_again(
    run_cli, slow_sim, rows_input, reference, tmp_path
):
    """The data object of a committed chunk is deleted (by hand, a lifecycle rule): its manifest vouches
    for nothing, so the next run collects that chunk again and publishes, instead of failing forever."""
    out = tmp_path / "out"
    args = [*run_args(rows_input, str(out), slow_sim), "--keep-chunks"]
    assert run_cli(*args).returncode == 0
    (out / "chunks" / "00004.jsonl").unlink()
    res = run_cli(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["metrics"]["chunks_run"] == 1  # chunk 4 alone, collected again
    assert (out / "rollouts.jsonl").read_bytes() == reference


@pytest.mark.parametrize("blocked", ["00001.jsonl", "00001.json"])
def test_allow_incomplete_publishes_exactly_the_committed_chunks(
    run_cli, slow_sim, rows_input, tmp_path, blocked
):
    """Chunk 1 never commits: a directory stands where its data object (nothing of it lands) or its
    manifest (the data object lands without one) must be written."""
    out = tmp_path / "out"
    (out / "chunks" / blocked).mkdir(parents=True)
    res = run_cli(
        *run_args(rows_input, str(out), slow_sim), "--limit", "200", "--allow-incomplete",
        env={"ROLLFLOW_COLLECTION__CHUNK_RETRIES": "0"},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    keys = [
        (row["_ng_task_index"], row["_ng_rollout_index"])
        for row in map(orjson.loads, (out / "rollouts.jsonl").read_bytes().splitlines())
    ]
    assert keys == [(t, r) for t in range(200) if not 40 <= t < 80 for r in range(2)]
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["published"] and report["missing_chunks"] == [1] and report["missing"] == 80
    assert ROWS > 200
