"""Where a published run's chunk data lies once its chunk objects are dropped: spans of the dataset.

A JSONL dataset is its committed chunks copied byte for byte in order, so after publishing each chunk
object is a span of it (offset, size, sha256). `dropped_chunks.json` records the spans and the
dataset's size; a chunk is then read from the dataset, and every reader checks the bytes against the
chunk's manifest as before, so a dataset edited since reads as a changed chunk, never as rollouts.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import IO, Any

import fsspec
import orjson

from rollflow.tasks.storage import owned
from rollflow.tasks.storage.store import Store, open_input, storage_options_for

SPANS = "dropped_chunks.json"


@dataclass(frozen=True)
class Span:
    offset: int
    size: int
    sha256: str

    @property
    def stamp(self) -> str:
        """The audit's stamp of a dropped chunk: its span, which holds exactly these bytes."""
        return f"span:{self.offset}:{self.size}:{self.sha256}"


class _Window(io.RawIOBase):
    """`size` bytes of an open file from where it stands."""

    def __init__(self, fh: IO[bytes], size: int) -> None:
        self._fh, self._left = fh, size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._fh.read(min(len(buffer), self._left)) if self._left > 0 else b""
        buffer[: len(data)] = data
        self._left -= len(data)
        return len(data)

    def close(self) -> None:
        self._fh.close()
        super().close()


def record(store: Store, run_id: str, dataset_url: str, spans: dict[int, Span], total: int) -> None:
    """Write the spans before any chunk object goes: a chunk is always in one place or the other."""
    doc = {
        "run_id": run_id,
        "dataset": owned.recorded(store, dataset_url, store.options),
        "at": owned.absolute_url(dataset_url, store.options),  # found there once the output has moved
        "dataset_bytes": total,
        "chunks": {str(i): [s.offset, s.size, s.sha256] for i, s in spans.items()},
    }
    store.write_bytes(SPANS, orjson.dumps(doc))


def _load(store: Store, run_id: str) -> dict[str, Any] | None:
    try:
        doc = orjson.loads(store.read_bytes(SPANS))
    except (FileNotFoundError, orjson.JSONDecodeError):
        return None
    return doc if isinstance(doc, dict) and doc.get("run_id") == run_id else None


def _dataset(store: Store, doc: dict[str, Any]) -> str:
    """Where the dataset is now: beside the output as recorded, or where it was published (moved)."""
    return owned.locate(store, doc["dataset"], doc.get("at"), store.options)


def span(store: Store, run_id: str, chunk: int) -> tuple[str, Span, int] | None:
    """(dataset URL, span, the dataset's size) of a dropped chunk of this run, or None."""
    doc = _load(store, run_id)
    found = doc["chunks"].get(str(chunk)) if doc is not None else None
    if doc is None or found is None:
        return None
    return _dataset(store, doc), Span(*found), doc["dataset_bytes"]


def is_published(url: str, size: int, options: dict[str, Any]) -> bool:
    """The dataset is there with the size it was published at (asked of the store, not a listing cache)."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options_for(url, options, fresh=False))
    fs.invalidate_cache(path)
    return bool(fs.exists(path)) and fs.size(path) == size


def lost_dataset(store: Store, run_id: str) -> str | None:
    """The dataset this run's dropped chunks lie in, when it is no longer the one published; else None."""
    doc = _load(store, run_id)
    if doc is None or not doc["chunks"]:
        return None
    url = _dataset(store, doc)
    return None if is_published(url, doc["dataset_bytes"], store.options) else url


def readable(store: Store, run_id: str) -> set[int]:
    """The dropped chunks of this run that the dataset still holds (one read, one look at the dataset)."""
    doc = _load(store, run_id)
    if doc is None:
        return set()
    url = _dataset(store, doc)
    if not is_published(url, doc["dataset_bytes"], store.options):
        return set()
    return {int(i) for i in doc["chunks"]}


def located(store: Store, run_id: str, chunk: int) -> tuple[str, Span]:
    """span(), while the dataset still is the one published (there, its size); else FileNotFoundError,
    so the chunk counts as lost and is collected again."""
    found = span(store, run_id, chunk)
    if found is None:
        raise FileNotFoundError(f"chunk {chunk} has neither its object nor a span of the dataset")
    url, where, size = found
    if not is_published(url, size, store.options):
        raise FileNotFoundError(f"{url} is not the dataset chunk {chunk} was published into")
    return url, where


def open_span(store: Store, run_id: str, chunk: int) -> IO[bytes]:
    """Chunk `chunk`'s bytes, read from the dataset it was published into."""
    url, where = located(store, run_id, chunk)
    window = _Window(open_input(url, store.options, offset=where.offset), where.size)
    return io.BufferedReader(window, 1 << 20)
