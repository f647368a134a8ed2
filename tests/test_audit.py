"""The audit catches what exactly-once forbids: duplicates, gaps, strays, bad rewards, tampering."""

from __future__ import annotations

from pathlib import Path

import orjson

from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.publish.audit import audit_chunk, audit_run
from rollflow.tasks.storage.ledger import ChunkManifest, Ledger
from rollflow.tasks.storage.store import Store


def line(t: int, r: int, reward: object = 1.0) -> bytes:
    return orjson.dumps({"_ng_task_index": t, "_ng_rollout_index": r, "reward": reward}) + b"\n"


def commit(ledger: Ledger, spec: ChunkSpec, data: bytes) -> ChunkManifest:
    manifest = ChunkManifest(
        chunk=spec.index, first_task=spec.first_task, num_tasks=spec.num_tasks,
        rows_expected=spec.good_rows * 2, rows=data.count(b"\n"), failed=0, sha256="", bytes=0,
        started_at="", committed_at="", wall_s=0.0, attempt=1,
    )  # fmt: skip
    ledger.commit(spec.index, data, None, manifest)
    return manifest


def test_clean_chunk_passes_and_is_cached(tmp_path: Path) -> None:
    ledger = Ledger(Store(str(tmp_path)))
    spec = ChunkSpec(0, 0, 3, 3, 0, 1)
    m = commit(ledger, spec, b"".join(line(t, r) for t in range(3) for r in range(2)))
    audit = audit_chunk(ledger, spec, m, 2)
    assert (audit.unique, audit.missing, audit.duplicates, audit.invalid) == (6, 0, 0, 0)
    assert (tmp_path / "audit" / "00000.json").exists()
    assert audit_chunk(ledger, spec, m, 2) == audit


def test_problems_are_found(tmp_path: Path) -> None:
    ledger = Ledger(Store(str(tmp_path)))
    spec = ChunkSpec(0, 10, 2, 2, 0, 1)
    data = line(10, 0) + line(10, 0) + line(11, 1, "yes") + line(12, 0) + b"{oops\n"
    m = commit(ledger, spec, data)
    audit = audit_chunk(ledger, spec, m, 2)
    assert audit.duplicates == 1 and audit.invalid == 2 and audit.missing_reward == 1
    assert audit.missing == 2
    other = ChunkSpec(1, 12, 2, 2, 0, 1)
    summary = audit_run(ledger, [spec, other], 2, {0: m})
    assert not summary.ok and summary.chunks_committed == 1 and summary.missing == 2 + 4


def test_tampering_breaks_the_sha(tmp_path: Path) -> None:
    ledger = Ledger(Store(str(tmp_path)))
    spec = ChunkSpec(0, 0, 1, 1, 0, 1)
    m = commit(ledger, spec, line(0, 0) + line(0, 1))
    (tmp_path / "chunks" / "00000.jsonl").write_bytes(line(0, 0) + line(0, 1, 0.0))
    audit = audit_chunk(ledger, spec, m, 2)
    assert not audit.sha_matches and any("sha256" in p for p in audit.problems)
    summary = audit_run(ledger, [spec], 2, {0: m})
    # withdrawn: its rows are no longer part of the dataset, so they count as missing
    assert summary.missing == 2 and summary.sha_mismatches == 1 and not summary.ok
    assert summary.uncommitted_chunks == [0] and summary.rows_written == 0
