"""Publishing a reverify: the dataset from its committed chunks (collection's concatenation, or Parquet),
tasks.jsonl, and failures.jsonl (every rollout that still failed, with its kind and response)."""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Any

from rollflow.tasks.publish.concat import concatenate, concatenate_chunk_files, concatenate_tasks
from rollflow.tasks.publish.failure_kinds import count_kinds
from rollflow.tasks.publish.parquet import write_parquet
from rollflow.tasks.reverify.source import SourceChunk
from rollflow.tasks.storage import owned
from rollflow.tasks.storage.ledger import ChunkManifest, Ledger

FAILURES_NAME = "failures.jsonl"


def write_failures(
    ledger: Ledger, chunks: list[SourceChunk], manifests: dict[int, ChunkManifest]
) -> Counter[str]:
    """failures.jsonl in the output (empty when none failed); returns the failures by kind."""
    kinds: Counter[str] = Counter()
    failed = [c.index for c in chunks if (m := manifests.get(c.index)) is not None and m.failed]
    owned.add(ledger.store, owned.FAILURES, [ledger.store.url(FAILURES_NAME)])
    count = partial(count_kinds, kinds=kinds)
    with ledger.store.open_write(FAILURES_NAME) as out:
        concatenate_chunk_files(ledger.store, failed, ledger.failures_path, out, count)
    return kinds


def publish_jsonl(
    ledger: Ledger,
    chunks: list[SourceChunk],
    manifests: dict[int, ChunkManifest],
    dataset_url: str,
    options: dict[str, Any],
) -> int:
    """rollouts.jsonl and tasks.jsonl, copied from the committed chunks as collection publishes them."""
    written = concatenate(ledger, chunks, manifests, dataset_url, options)  # type: ignore[arg-type]
    concatenate_tasks(ledger, chunks, manifests, dataset_url, options)  # type: ignore[arg-type]
    return written


def publish_parquet(
    ledger: Ledger,
    chunks: list[SourceChunk],
    manifests: dict[int, ChunkManifest],
    data_url: str,
    dataset_url: str,
    options: dict[str, Any],
) -> list[str]:
    """Sharded Parquet under `data_url` and tasks.jsonl beside `dataset_url`'s folder."""
    ordered = [manifests[c.index] for c in chunks if c.index in manifests]
    names = write_parquet(ledger, ordered, data_url, options)
    concatenate_tasks(ledger, chunks, manifests, dataset_url, options)  # type: ignore[arg-type]
    return names
