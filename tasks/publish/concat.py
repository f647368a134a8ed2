"""concatenate: stream committed chunks, in order, into one dataset object that appears whole."""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Callable, Iterable
from typing import IO, Any

from rollflow.tasks.collect.paths import tasks_url
from rollflow.tasks.collect.rows import ChunkSpec
from rollflow.tasks.publish.audit import tasks_path
from rollflow.tasks.storage import chunk_spans, owned
from rollflow.tasks.storage.ledger import ChunkManifest, Ledger
from rollflow.tasks.storage.store import StorageError, Store, describe_error

COPY_BLOCK = 4 * 1024 * 1024


class ChunkChanged(StorageError):
    """A chunk object changed between its audit and its copy; nothing was published."""


class PublishFailed(StorageError):
    """Writing the dataset (or its per-task file) failed: nothing appeared there, the chunks are kept."""


def split_url(url: str) -> tuple[str, str]:
    """(parent URL, object name) of a dataset URL, for a Store rooted at the parent."""
    parent, name = posixpath.split(url.rstrip("/"))
    return parent or ".", name


def publish_failed(url: str, ledger: Ledger, needed: int | None, exc: OSError) -> PublishFailed:
    reason = describe_error(url, exc, "choose another dataset path")
    size = f"The dataset needs {needed:,} bytes; once" if needed is not None else "Once"
    return PublishFailed(
        f"Publishing {url} failed: {reason}. Nothing was published there (the partial copy was removed) "
        f"and the committed chunks in {ledger.store.root_url} are untouched. {size} it can be written, "
        f"run the same command again: it publishes without collecting anything again."
    )


def concatenate(
    ledger: Ledger,
    chunks: list[ChunkSpec],
    manifests: dict[int, ChunkManifest],
    dataset_url: str,
    storage_options: dict[str, Any],
) -> int:
    """Copy the committed chunk objects byte for byte into `dataset_url`; returns the bytes written.

    Chunk objects are already ordered by (task, rollout) and chunks cover ascending task ranges, so a
    plain in-order copy gives the ordered dataset without parsing or holding any of it. Only chunks with
    a manifest are copied (a data object without one is no commit), and each copy is hashed against its
    manifest: bytes that changed after the audit abort the publish and the dataset object never appears.
    A full disk (or any other write error) is one PublishFailed; partial copies a killed run left are
    removed first.
    """
    parent, name = split_url(dataset_url)
    target = Store(parent, storage_options)
    owned.add(ledger.store, owned.DATASET, [dataset_url], storage_options)  # before it exists
    target.remove_stale_copies(name)
    needed = sum(m.bytes for i, m in manifests.items() if i in {c.index for c in chunks})
    try:
        return _copy_chunks(ledger, chunks, manifests, target, name)
    except OSError as exc:
        raise publish_failed(dataset_url, ledger, needed, exc) from exc


def _copy_chunks(
    ledger: Ledger, chunks: list[ChunkSpec], manifests: dict[int, ChunkManifest], target: Store, name: str
) -> int:
    written = 0
    with target.open_write(name) as out:
        for spec in chunks:
            manifest = manifests.get(spec.index)
            if manifest is None:
                continue
            digest = hashlib.sha256()
            with ledger.open_chunk(spec.index) as fh:
                while block := fh.read(COPY_BLOCK):
                    digest.update(block)
                    out.write(block)
                    written += len(block)
            if digest.hexdigest() != manifest.sha256:
                raise chunk_changed(ledger, spec.index)
    return written


def chunk_changed(ledger: Ledger, index: int) -> ChunkChanged:
    """Chunk `index`'s bytes are not those its manifest vouches for: the commit is withdrawn, and where
    the bytes were read is said (its object, or the published dataset, once the object was dropped)."""
    found = (
        None
        if ledger.store.exists(ledger.chunk_path(index))
        else chunk_spans.span(ledger.store, ledger.run_id, index)
    )
    ledger.uncommit(index)
    where = (
        f"its rows in {found[0]}, the dataset it was published into, were edited since"
        if found is not None
        else f"its data object {ledger.store.url(ledger.chunk_path(index))} changed since"
    )
    return ChunkChanged(
        f"Nothing was published: chunk {index} of {ledger.store.root_url} is not what was verified "
        f"({where}), and its commit was withdrawn. Run the same command again: it redoes that chunk."
    )


def concatenate_tasks(
    ledger: Ledger,
    chunks: list[ChunkSpec],
    manifests: dict[int, ChunkManifest],
    dataset_url: str,
    storage_options: dict[str, Any],
) -> int:
    """`<dataset stem>.tasks.jsonl` beside the dataset: each committed chunk's per-task reward lines
    (written by its audit), in chunk order, so a user selects prompts without re-reading the dataset.

    The output records the file before writing it, so a --restart removes it and nothing else."""
    url = tasks_url(dataset_url)
    parent, name = split_url(url)
    target = Store(parent, storage_options)
    try:
        owned.add(ledger.store, owned.TASKS, [url], storage_options)
        target.remove_stale_copies(name)
        with target.open_write(name) as out:
            committed = [spec.index for spec in chunks if spec.index in manifests]
            written = concatenate_chunk_files(ledger.store, committed, tasks_path, out)
    except OSError as exc:
        raise publish_failed(url, ledger, None, exc) from exc
    return written


def concatenate_chunk_files(
    store: Store,
    indexes: Iterable[int],
    path: Callable[[int], str],
    out: IO[bytes],
    look: Callable[[bytes], None] | None = None,
) -> int:
    """Each chunk's own small object (`path(index)`: its per-task lines, its failures), in the order given,
    appended to `out`; `look` sees each before it is written. Returns the bytes written."""
    written = 0
    for index in indexes:
        block = store.read_bytes(path(index))
        if look is not None:
            look(block)
        out.write(block)
        written += len(block)
    return written
