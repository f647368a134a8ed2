"""After a JSONL publish, the chunk objects go: the dataset holds their bytes (no second full copy).

The spans are recorded first, each audit cache then names the span as what it audited, and only then are
the objects deleted, so a kill anywhere leaves every chunk readable from one place or the other. Resume,
republish, `reverify --failed-only` and the audit read a dropped chunk from the dataset (chunk_spans.py).
Failures, manifests and audit results stay: they are small, and they are what a rerun needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import fsspec
import orjson

from rollflow.tasks.publish.audit import AUDIT_DIR
from rollflow.tasks.storage import chunk_spans
from rollflow.tasks.storage.chunk_spans import Span
from rollflow.tasks.storage.ledger import ChunkManifest, Ledger
from rollflow.tasks.storage.store import storage_options_for


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
    fs, path = fsspec.core.url_to_fs(dataset_url, **storage_options_for(dataset_url, options, fresh=False))
    if not spans or not fs.exists(path) or fs.size(path) != offset:
        return 0
    store = ledger.store
    chunk_spans.record(store, ledger.run_id, dataset_url, spans, offset)
    for index in spans:
        _restamp_audit(ledger, index)
    freed = 0
    for index, span in spans.items():
        if store.exists(ledger.chunk_path(index)):
            store.delete(ledger.chunk_path(index))
            freed += span.size
    return freed


def _restamp_audit(ledger: Ledger, index: int) -> None:
    """The audit's cached result of chunk `index` now vouches for its span (same bytes, same sha256)."""
    rel = f"{AUDIT_DIR}/{index:05d}.json"
    if not ledger.store.exists(rel):
        return
    cached = orjson.loads(ledger.store.read_bytes(rel))
    found = chunk_spans.span(ledger.store, ledger.run_id, index)
    if found is None or cached.get("sha256") != found[1].sha256:
        return
    cached["stamp"] = found[1].stamp
    ledger.store.write_bytes(rel, orjson.dumps(cached))
