"""The chunk ledger on local disk and S3: run identity, commit order, what counts as committed."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import orjson
import pytest

from rollflow.tasks.storage.ledger import ChunkManifest, IdentityMismatch, Ledger, RunIdentity
from rollflow.tasks.storage.store import Store


class RecordingStore(Store):
    """A real Store that also notes the order of writes and how often a directory is listed."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.writes: list[str] = []
        self.listings = 0

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.writes.append(rel)
        super().write_bytes(rel, data)

    def list(self, rel_dir: str) -> list[str]:
        self.listings += 1
        return super().list(rel_dir)


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> RecordingStore:
    if request.param == "local":
        return RecordingStore(str(tmp_path / "out"))
    s3 = request.getfixturevalue("moto_s3")
    return RecordingStore(f"s3://{s3.new_bucket()}/run")


def identity(**changes) -> RunIdentity:
    fields = {
        "input_url": "/data/in.jsonl",
        "input_fingerprint": "ab12" + "0" * 60,
        "rows": 10,
        "tasks": 10,
        "num_repeats": 2,
        "chunk_size": 5,
        "config": {"kind": "responses", "model": "a", "overrides": {}},
        "config_hash": "h1",
        "chunks": [
            {"index": 0, "first_task": 0, "num_tasks": 5},
            {"index": 1, "first_task": 5, "num_tasks": 5},
        ],
        "parallelism": 8,
        "created_at": "2025-01-01T00:00:00+00:00",
        "rollflow_version": "0.1.0",
    }
    return RunIdentity(**{**fields, **changes})


def manifest(i: int, rows: int = 10) -> ChunkManifest:
    return ChunkManifest(
        chunk=i,
        first_task=i * 5,
        num_tasks=5,
        rows_expected=10,
        rows=rows,
        failed=10 - rows,
        sha256="",
        bytes=0,
        started_at="2025-01-01T00:00:00+00:00",
        committed_at="",
        wall_s=1.5,
        attempt=1,
        stats={"latency_p50_s": 0.1},
    )


def data_for(i: int) -> bytes:
    return b"".join(orjson.dumps({"_ng_task_index": i * 5 + t}) + b"\n" for t in range(5))


def test_new_run_then_same_run_resumes(store: RecordingStore) -> None:
    ledger = Ledger(store)
    first = ledger.open_run(identity(), restart=False)
    assert RunIdentity.model_validate_json(store.read_bytes("run.json")) == first
    again = ledger.open_run(identity(created_at="2030-01-01T00:00:00+00:00", parallelism=32), restart=False)
    assert again.created_at == "2025-01-01T00:00:00+00:00" and again.parallelism == 32
    assert RunIdentity.model_validate_json(store.read_bytes("run.json")).parallelism == 32
    ledger.update_parallelism(48)
    assert ledger.open_run(identity(parallelism=None), restart=False).parallelism == 48


def test_changed_run_is_refused_with_every_change(store: RecordingStore) -> None:
    ledger = Ledger(store)
    ledger.open_run(identity(), restart=False)
    ledger.commit(0, data_for(0), None, manifest(0))
    changed = identity(
        input_fingerprint="cd34" + "0" * 60,
        num_repeats=4,
        config={"kind": "responses", "model": "b", "overrides": {}},
        config_hash="h2",
    )
    with pytest.raises(IdentityMismatch) as info:
        ledger.open_run(changed, restart=False)
    message = str(info.value)
    assert store.root_url in message and "1 committed chunks" in message
    for needle in (
        "input fingerprint changed (sha256 ab12",
        "cd34",
        "num_repeats 2 -> 4",
        "config.model 'a' -> 'b'",
    ):
        assert needle in message
    assert "were kept" in message and "--output" in message and "--restart" in message
    assert list(ledger.committed()) == [0]
    assert RunIdentity.model_validate_json(store.read_bytes("run.json")).num_repeats == 2


def test_restart_discards_the_old_run(store: RecordingStore) -> None:
    ledger = Ledger(store)
    ledger.open_run(identity(), restart=False)
    ledger.commit(0, data_for(0), b'{"error": "x"}\n', manifest(0, rows=9))
    for rel in ("rollouts.jsonl", "report.json", "report.md", "bad_rows.jsonl"):
        store.write_bytes(rel, b"old")
    new = ledger.open_run(identity(num_repeats=3, config_hash="h3"), restart=True)
    assert new.num_repeats == 3
    assert ledger.committed() == {}
    assert store.list("chunks") == [] and store.list("failures") == []
    # the new run's identity and its record of what it publishes, empty (the old run's files are gone)
    assert store.list("") == ["published.json", "run.json"] and store.read_bytes("published.json") == b"{}"


def test_commit_writes_manifest_last(store: RecordingStore) -> None:
    ledger = Ledger(store)
    data = data_for(3)
    store.write_bytes(ledger.failures_path(3), b"stale\n")
    store.writes.clear()
    ledger.commit(3, data, b'{"error": "boom"}\n', manifest(3, rows=9))
    assert store.writes == ["chunks/00003.jsonl", "failures/00003.jsonl", "chunks/00003.json"]
    m = ledger.manifest(3)
    assert m is not None and m.sha256 == hashlib.sha256(data).hexdigest() and m.bytes == len(data)
    assert m.committed_at and m.stats == {"latency_p50_s": 0.1}
    # a retried chunk that now has no failures removes the stale failures object
    ledger.commit(3, data, None, manifest(3))
    assert not store.exists(ledger.failures_path(3))
    assert ledger.manifest(3).failed == 0


def test_only_a_manifest_commits(store: RecordingStore) -> None:
    ledger = Ledger(store)
    for i in (0, 2, 5):
        ledger.commit(i, data_for(i), None, manifest(i))
    store.write_bytes(ledger.chunk_path(1), data_for(1))  # killed before its manifest
    store.write_bytes(ledger.manifest_path(4), b'{"chunk": 4, "first_ta')  # torn manifest
    store.write_bytes("chunks/notes.json", b"{}")
    store.listings = 0
    found = ledger.committed()
    assert list(found) == [0, 2, 5] and store.listings == 1
    assert found[2].first_task == 10 and found[2].sha256 == hashlib.sha256(data_for(2)).hexdigest()
    assert ledger.manifest(1) is None and ledger.manifest(4) is None and ledger.manifest(9) is None
    assert Ledger(store).committed().keys() == found.keys()  # a fresh reader sees the same


def test_chunk_reads_and_bad_rows(store: RecordingStore) -> None:
    ledger = Ledger(store)
    data = b"".join(orjson.dumps({"row": i, "pad": "x" * 100}) + b"\n" for i in range(20_000))
    ledger.commit(0, data, None, manifest(0))
    with ledger.open_chunk(0) as fh:
        assert fh.read() == data
    with ledger.open_chunk(0) as fh:
        assert sum(1 for _ in fh) == 20_000
    assert ledger.chunk_path(12) == "chunks/00012.jsonl"
    assert ledger.manifest_path(12) == "chunks/00012.json"
    assert ledger.failures_path(12) == "failures/00012.jsonl"
    ledger.write_bad_rows([b'{"line": 2}', b'{"line": 5}\n'])
    assert store.read_bytes("bad_rows.jsonl") == b'{"line": 2}\n{"line": 5}\n'
    ledger.write_bad_rows(io.BytesIO(b'{"line": 7}\n'))
    assert store.read_bytes("bad_rows.jsonl") == b'{"line": 7}\n'
