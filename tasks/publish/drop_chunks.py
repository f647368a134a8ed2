"""After a JSONL publish, the chunk objects go: the dataset holds their bytes (no second full copy).

The spans are recorded first, each audit cache then names the span as what it audited, and only then are
the objects deleted, so a kill anywhere leaves every chunk readable from one place or the other. Resume,
republish, `reverify --failed-only` and the audit read a dropped chunk from the dataset (chunk_spans.py).
Failures, manifests and audit results stay: they are small, and they are what a rerun needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import orjson

from rollflow.tasks.publish.audit import AUDIT_DIR
from rollflow.tasks.storage import chunk_spans
from rollflow.tasks.storage.chunk_spans import Span
from rollflow.tasks.storage.ledger import ChunkManifest, Ledger


class _Chunk(Protocol):
    @property
    def index(self) -> int: ...


def drop_chunk_data(
    ledger: Ledger,
    chunks: Sequence[_Chunk],
    manifests: dict[int, ChunkManifest],
    dataset_url: str,
    options: dict[str, Any],
) -> int:
    """Delete the chunk objects the published dataset holds; returns the bytes freed (0 when the dataset
    is not the concatenation of these manifests, which then keeps every object)."""
    spans: dict[int, Span] = {}
    offset = 0
    for chunk in chunks:
        manifest = manifests.get(chunk.index)
        if manifest is not None:
            spans[chunk.index] = Span(offset, manifest.bytes, manifest.sha256)
            offset += manifest.bytes
    if not spans or not chunk_spans.is_published(dataset_url, offset, options):
        return 0
    store = ledger.store
    chunk_spans.record(store, ledger.run_id, dataset_url, spans, offset)
    for index, span in spans.items():
        _restamp_audit(ledger, index, span)
    freed = 0
    for index, span in spans.items():
        if store.exists(ledger.chunk_path(index)):
            store.delete(ledger.chunk_path(index))
            freed += span.size
    return freed


def _restamp_audit(ledger: Ledger, index: int, span: Span) -> None:
    """The audit's cached result of chunk `index` now vouches for its span (same bytes, same sha256)."""
    rel = f"{AUDIT_DIR}/{index:05d}.json"
    if not ledger.store.exists(rel):
        return
    cached = orjson.loads(ledger.store.read_bytes(rel))
    if cached.get("sha256") != span.sha256:
        return
    cached["stamp"] = span.stamp
    ledger.store.write_bytes(rel, orjson.dumps(cached))
