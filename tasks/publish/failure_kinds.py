"""Failed rollouts counted by their error's kind, one way for a collection's report and a reverify's
failures.jsonl: both read the committed chunks' failures objects of the ledger."""

from __future__ import annotations

from collections import Counter

from rollflow.tasks.storage import rowjson
from rollflow.tasks.storage.ledger import ChunkManifest, Ledger


def count_kinds(block: bytes, kinds: Counter[str]) -> None:
    """Adds each failure line of `block` (a chunk's failures object) to `kinds` under its `error.kind`."""
    for line in block.splitlines():
        if line.strip():
            kinds[rowjson.failure_kind(line)] += 1


def failures_by_kind(ledger: Ledger, manifests: dict[int, ChunkManifest]) -> dict[str, int]:
    """The committed chunks' failures by kind, most first (report.json's `story.returned`)."""
    kinds: Counter[str] = Counter()
    for index, manifest in manifests.items():
        if manifest.failed:
            count_kinds(ledger.store.read_bytes(ledger.failures_path(index)), kinds)
    return dict(kinds.most_common())
