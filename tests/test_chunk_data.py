"""What a published run keeps: the dataset holds the chunks' bytes, so the chunk objects go after a JSONL
publish (--keep-chunks keeps them) while resume, republish and reverify read them from the dataset."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
from rollout_data import assert_complete, flaky_verifier, write_rows


def _collect(run_cli, inp: Path, out: Path, url: str, *extra: str):
    return run_cli(
        "collect", "--input", str(inp), "--output", str(out), "--backend-kind", "chat", "--backend-url", url,
        "--num-repeats", "2", "--parallelism", "8", "--chunk-size", "8", "--verifier", "exact_match",
        "--verify-processes", "0", "--no-progress", "--seed", "7", *extra,
    )  # fmt: skip


def _chunk_objects(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "chunks").glob("*.jsonl"))


def test_a_published_run_keeps_one_copy_and_runs_again_as_itself(run_cli, fast_sim, tmp_path: Path) -> None:
    inp, out = write_rows(tmp_path / "rows.jsonl", 20), tmp_path / "run"
    res = _collect(run_cli, inp, out, fast_sim.url)
    assert res.returncode == 0, res.stderr[-3000:]
    dataset = (out / "rollouts.jsonl").read_bytes()
    assert_complete(dataset.splitlines(), 20, 2)
    assert _chunk_objects(out) == []  # the dataset is the one copy
    manifests = sorted(p.name for p in (out / "chunks").glob("*.json"))
    assert manifests == ["00000.json", "00001.json", "00002.json"]  # 8 + 8 + 4 tasks
    assert (out / "dropped_chunks.json").exists()
    report = orjson.loads((out / "report.json").read_bytes())
    assert report["chunk_data"] == {"kept": False, "freed_bytes": len(dataset)}
    # the same command again: nothing collected, the same dataset published from its own spans
    res = _collect(run_cli, inp, out, fast_sim.url, "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "rollouts.jsonl").read_bytes() == dataset
    assert orjson.loads((out / "report.json").read_bytes())["rows_written"] == 40
    # a moved folder too
    moved = tmp_path / "moved"
    shutil.move(out, moved)
    res = _collect(run_cli, inp, moved, fast_sim.url)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (moved / "rollouts.jsonl").read_bytes() == dataset


def test_keep_chunks_keeps_the_chunk_objects(run_cli, fast_sim, tmp_path: Path) -> None:
    inp, out = write_rows(tmp_path / "rows.jsonl", 20), tmp_path / "run"
    res = _collect(run_cli, inp, out, fast_sim.url, "--keep-chunks")
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(_chunk_objects(out)) == 3 and not (out / "dropped_chunks.json").exists()
    data = b"".join((out / "chunks" / name).read_bytes() for name in _chunk_objects(out))
    assert data == (out / "rollouts.jsonl").read_bytes()


def test_a_dataset_gone_after_its_chunks_were_dropped_is_collected_again(
    run_cli, fast_sim, tmp_path: Path
) -> None:
    """The spans vouch only while the dataset is the one published: deleted or edited, its chunks count
    as lost and the same command collects them again, never publishing what was not collected."""
    inp, out = write_rows(tmp_path / "rows.jsonl", 20), tmp_path / "run"
    assert _collect(run_cli, inp, out, fast_sim.url).returncode == 0
    dataset = (out / "rollouts.jsonl").read_bytes()
    (out / "rollouts.jsonl").write_bytes(dataset[:-200])  # edited: cut short
    res = _collect(run_cli, inp, out, fast_sim.url)
    assert res.returncode == 0, res.stderr[-3000:]
    said = " ".join((res.stdout + res.stderr).split())
    assert "is gone or was changed since" in said and "collected again" in said, said[-3000:]
    assert (out / "rollouts.jsonl").read_bytes() == dataset  # seeded: collected again, the same rollouts
    (out / "rollouts.jsonl").unlink()
    res = _collect(run_cli, inp, out, fast_sim.url)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "rollouts.jsonl").read_bytes() == dataset


def test_reverify_of_a_run_without_chunk_objects(run_cli, fast_sim, tmp_path: Path) -> None:
    inp, out, rv = write_rows(tmp_path / "rows.jsonl", 20), tmp_path / "run", tmp_path / "rv"
    assert _collect(run_cli, inp, out, fast_sim.url).returncode == 0
    res = run_cli("reverify", str(out), "--output", str(rv), "--verifier", "math_fast", "--chunk-size", "8")
    assert res.returncode == 0, res.stderr[-3000:]
    assert _chunk_objects(rv) == []
    assert_complete((rv / "rollouts.jsonl").read_bytes().splitlines(), 20, 2)
    res = run_cli("reverify", str(out), "--output", str(rv), "--verifier", "math_fast", "--chunk-size", "8")
    assert res.returncode == 0, res.stderr[-3000:]  # its own rerun reads its spans


FLAKY = flaky_verifier("4")


def test_failed_only_never_completes_rows_edited_in_the_published_dataset(
    run_cli, fast_sim, tmp_path: Path
) -> None:
    """--failed-only read a dropped chunk from the dataset without its commit's hash: a reward edited there
    (same size) was published as rescored, exit 0. It is refused, naming the chunk, and nothing published."""
    (tmp_path / "flaky_verifier.py").write_text(FLAKY)
    inp, out = write_rows(tmp_path / "rows.jsonl", 20), tmp_path / "run"
    res = run_cli(
        "collect", "--input", str(inp), "--output", str(out), "--backend-kind", "chat", "--backend-url",
        fast_sim.url, "--num-repeats", "2", "--chunk-size", "8", "--verifier", "flaky_verifier:verify",
        "--verify-processes", "0", "--no-progress", "--allow-incomplete", env={"PYTHONPATH": str(tmp_path)},
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert _chunk_objects(out) == []
    dataset = out / "rollouts.jsonl"
    data = dataset.read_bytes()
    edited = data.replace(b'"reward":1.0', b'"reward":0.0', 1)
    assert edited != data
    dataset.write_bytes(edited)
    rv = tmp_path / "rv"
    args = ["reverify", str(out), "--output", str(rv), "--verifier", "exact_match", "--failed-only"]
    res = run_cli(*args)
    assert res.returncode != 0 and "not those its run committed" in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and not (rv / "rollouts.jsonl").exists(), res.stderr[-3000:]
    # a damaged failure record is refused at its file and line, before anything is rescored
    dataset.write_bytes(data)
    failures = sorted((out / "failures").glob("*.jsonl"))[0]
    lines = failures.read_bytes().splitlines(keepends=True)
    failures.write_bytes(b"".join([lines[0][:30] + b"\n", *lines[1:]]))
    res = run_cli(*args, "--restart")
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"failures/{failures.name} line 1:" in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_a_parquet_publish_over_an_edited_dataset_is_one_paragraph(run_cli, fast_sim, tmp_path: Path) -> None:
    """Chunks dropped by a JSONL publish, the dataset then edited, the same run published as Parquet: a
    ValueError with two tracebacks; now the chunk is named, its commit withdrawn, and a rerun recovers."""
    inp, out = write_rows(tmp_path / "rows.jsonl", 20), tmp_path / "run"
    assert _collect(run_cli, inp, out, fast_sim.url).returncode == 0
    dataset = out / "rollouts.jsonl"
    dataset.write_bytes(dataset.read_bytes().replace(b'"reward":1.0', b'"reward":0.0', 1))
    res = _collect(run_cli, inp, out, fast_sim.url, "--format", "parquet")
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "chunk 0" in res.stderr, res.stderr[-3000:]
    assert "the dataset it was published into, were edited" in " ".join(res.stderr.split())
    res = _collect(run_cli, inp, out, fast_sim.url, "--format", "parquet")
    assert res.returncode == 0, res.stderr[-3000:]
    assert len(list((out / "data").glob("*.parquet"))) >= 1
