"""What a published run keeps: the dataset holds the chunks' bytes, so the chunk objects go after a JSONL
publish (--keep-chunks keeps them) while resume, republish and reverify read them from the dataset."""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
from rollout_data import assert_complete, write_rows


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
