"""concatenate: stream committed chunks, in order, into one dataset object that appears whole."""

from __future__ import annotations

import posixpath
from typing import Any

from tasks.ledger import Ledger
from tasks.rows import ChunkSpec
from tasks.storage import Store

COPY_BLOCK = 4 * 1024 * 1024


def split_url(url: str) -> tuple[str, str]:
    """(parent URL, object name) of a dataset URL, for a Store rooted at the parent."""
    parent, name = posixpath.split(url.rstrip("/"))
    return parent or ".", name


def concatenate(
    ledger: Ledger, chunks: list[ChunkSpec], dataset_url: str, storage_options: dict[str, Any]
) -> int:
    """Copy chunk objects byte for byte into `dataset_url`; returns the bytes written.

    Chunk objects are already ordered by (task, rollout) and chunks cover ascending task ranges, so a
    plain in-order copy gives the ordered dataset without parsing or holding any of it.
    """
    parent, name = split_url(dataset_url)
    target = Store(parent, storage_options)
    written = 0
    with target.open_write(name) as out:
        for spec in chunks:
            with ledger.open_chunk(spec.index) as fh:
                while block := fh.read(COPY_BLOCK):
                    out.write(block)
                    written += len(block)
    return written
