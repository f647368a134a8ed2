"""Sharded Parquet from committed chunks: every row back as it was in JSONL, shards written once, read by
pyarrow and by Hugging Face `datasets`."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pyarrow.dataset as pads
import pytest

from rollflow.tasks.publish.parquet import write_parquet
from rollflow.tasks.storage.ledger import ChunkManifest, Ledger, RunIdentity
from rollflow.tasks.storage.store import Store

pytestmark = pytest.mark.concurrent


def make_row(task: int, rollout: int) -> dict:
    row: dict = {
        "responses_create_params": {"input": [{"role": "user", "content": f"q{task}"}], "temperature": 0.5},
        "expected_answer": str(task) if task % 3 else task,  # mixed types: kept as JSON text
        "response": {
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "x" * task}]}]
        },
        "reward": 1 if rollout == 0 else 0.5,  # ints and floats: float64
        "_ng_task_index": task,
        "_ng_rollout_index": rollout,
        "_rf": {"attempts": 1},
    }
    if task % 2:
        row["note"] = f"only on odd tasks {task}"  # absent elsewhere: null
        row["response"]["usage"] = {"output_tokens": task}  # a nested shape that varies
    return row


def committed_ledger(root: Path, chunks: int, tasks_per_chunk: int) -> tuple[Ledger, list[ChunkManifest]]:
    ledger = Ledger(Store(str(root)))
    ledger.open_run(
        RunIdentity(
            input_url="x", input_fingerprint="f", rows=0, tasks=0, num_repeats=2, chunk_size=1, config={},
            config_hash="h", chunks=[], created_at="t", rollflow_version="0",
        ),
        restart=False,
    )  # fmt: skip
    manifests = []
    for c in range(chunks):
        tasks = range(c * tasks_per_chunk, (c + 1) * tasks_per_chunk)
        data = b"".join(orjson.dumps(make_row(t, r)) + b"\n" for t in tasks for r in range(2))
        manifest = ChunkManifest(
            chunk=c, first_task=tasks[0], num_tasks=len(tasks), rows_expected=2 * len(tasks),
            rows=2 * len(tasks), failed=0, sha256="", bytes=0, started_at="", committed_at="", wall_s=0,
            attempt=1,
        )  # fmt: skip
        ledger.commit(c, data, None, manifest)
        manifests.append(manifest)
    return ledger, manifests


def read_back(data_dir: Path) -> list[dict]:
    table = pads.dataset(str(data_dir), format="parquet").to_table()
    json_columns = set(json.loads(table.schema.metadata[b"rollflow.json_columns"]))
    return [
        {k: (json.loads(v) if k in json_columns else v) for k, v in row.items() if v is not None}
        for row in table.to_pylist()
    ]


def test_parquet_shards_hold_every_row_as_jsonl_and_are_written_once(tmp_path) -> None:
    ledger, manifests = committed_ledger(tmp_path / "out", chunks=5, tasks_per_chunk=10)
    data = tmp_path / "out" / "data"
    names = write_parquet(ledger, manifests, str(data), {}, shard_rows=40)
    assert names == [f"train-0000{i}-of-00003.parquet" for i in range(3)]  # 2 + 2 + 1 chunks of 20 rows
    expected = [make_row(t, r) for t in range(50) for r in range(2)]
    got = read_back(data)
    for row in expected:
        row["reward"] = float(row["reward"])
    assert got == expected
    assert [type(r["reward"]) for r in got] == [float] * 100
    stamps = {p.name: p.stat().st_mtime_ns for p in data.iterdir()}
    assert write_parquet(ledger, manifests, str(data), {}, shard_rows=40) == names
    assert {p.name: p.stat().st_mtime_ns for p in data.iterdir()} == stamps  # resumed: nothing rewritten
    assert write_parquet(ledger, manifests, str(data), {}, shard_rows=1000) == [
        "train-00000-of-00001.parquet"
    ]
    assert sorted(p.name for p in data.iterdir()) == ["train-00000-of-00001.parquet"]  # stale shards gone
    assert read_back(data) == got


def test_datasets_loads_the_shards(tmp_path, monkeypatch) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    ledger, manifests = committed_ledger(tmp_path / "out", chunks=2, tasks_per_chunk=5)
    write_parquet(ledger, manifests, str(tmp_path / "out" / "data"), {}, shard_rows=10)
    ds = datasets.load_dataset(
        "parquet", data_dir=str(tmp_path / "out" / "data"), split="train", cache_dir=str(tmp_path / "c")
    )
    assert ds.num_rows == 20
    assert ds["reward"] == [1.0, 0.5] * 10
    assert [json.loads(r) for r in ds["response"]] == [
        make_row(t, r)["response"] for t in range(10) for r in range(2)
    ]


def test_a_restart_that_does_not_publish_leaves_nothing_of_the_discarded_run(
    run_cli, fast_sim, tmp_path
) -> None:
    """A --restart with other settings discarded the run but left OUT/data/*.parquet and OUT/README.md,
    which `datasets.load_dataset` then loaded as the output's data; a dead partial shard is removed too."""
    from cli_runs import run_args
    from rollout_data import write_rows

    from rollflow.infra.local import free_port

    inp, out = write_rows(tmp_path / "rows.jsonl", 20), tmp_path / "out"
    res = run_cli(*run_args(inp, str(out), fast_sim), "--format", "parquet")
    assert res.returncode == 0, res.stderr
    shards = sorted((out / "data").glob("*.parquet"))
    assert shards and (out / "README.md").exists()
    (out / "data" / f"{shards[0].name}.tmp-123-dead").write_bytes(b"partial")
    (out / "data" / "mine.txt").write_text("a user's file")
    dead = f"http://127.0.0.1:{free_port()}"
    args = [a if a != fast_sim.url else dead for a in run_args(inp, str(out), fast_sim)]
    res = run_cli(*args, "--format", "parquet", "--restart", "--num-repeats", "3")
    assert res.returncode == 2, res.stderr
    assert sorted(p.name for p in (out / "data").iterdir()) == ["mine.txt"]
    assert not (out / "README.md").exists()
