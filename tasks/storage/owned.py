"""What a run owns: one record, `published.json` in the output, of every object its publish wrote.

Each object is recorded before it is written, relative to the output when inside it (so a moved or copied
output folder is still itself), where it lives otherwise. A restart removes exactly what is recorded and
nothing else; a file beside the dataset may be replaced only when it is recorded here.
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

import fsspec
import orjson

from rollflow.tasks.storage.store import Store, storage_options_for

OWNED = "published.json"

# The kinds of object a publish writes. The record keeps them apart only so a message can name them.
DATASET, SHARDS, TASKS, CARDS, REPORT, FAILURES, NEMO_GYM = (
    "dataset",
    "shards",
    "tasks",
    "cards",
    "report",
    "failures",
    "nemo_gym",
)
KINDS = (DATASET, SHARDS, TASKS, CARDS, REPORT, FAILURES, NEMO_GYM)

SHARD = re.compile(r"^train-\d{5}-of-\d{5}\.parquet$")  # the Parquet shards rollflow writes
SHARD_MARKS = "parquet"  # their markers, in the output: run state, not published data
# What an output published before it kept this record held at these names; a restart removes them too.
UNRECORDED = ("rollouts.jsonl", "report.json", "report.md", "throughput.png", "rewards.png", "README.md")


def location(url: str, options: dict[str, Any] | None) -> tuple[str, str, Any]:
    """(protocol, normalised path, filesystem): two URLs name one object when the first two are equal."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options_for(url, options, fresh=False))
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol, posixpath.normpath(fs._strip_protocol(path)), fs


def absolute_url(url: str, options: dict[str, Any] | None) -> str:
    """The URL as a location: `out/x` and `./out/x` typed in any folder name one file, recorded once."""
    protocol, path, _ = location(url, options)
    return path if protocol in ("file", "local") else f"{protocol}://{path}"


def _record(store: Store) -> dict[str, Any]:
    try:
        record = orjson.loads(store.read_bytes(OWNED))
    except (FileNotFoundError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _resolved(store: Store, recorded: str) -> str:
    return recorded if recorded.startswith("/") or "://" in recorded else store.url(recorded)


def _recorded(store: Store, url: str, options: dict[str, Any] | None) -> str:
    """Where a published object is recorded: relative to the output when inside it, else where it is."""
    located = absolute_url(url, options)
    protocol = store.fs.protocol if isinstance(store.fs.protocol, str) else store.fs.protocol[0]
    root = posixpath.normpath(store.root)
    root = root if protocol in ("file", "local") else f"{protocol}://{root}"
    prefix = root.rstrip("/") + "/"
    return located[len(prefix) :] if located.startswith(prefix) else located


def owned(store: Store, kind: str) -> list[str]:
    """The URLs of one kind of object this output published, from its record."""
    return [_resolved(store, u) for u in _record(store).get(kind, [])]


def record(store: Store, kind: str, urls: list[str], options: dict[str, Any] | None = None) -> None:
    """The objects of `kind` this output owns from now on (replacing the kind's earlier list)."""
    located = sorted({_recorded(store, u, options) for u in urls})
    store.write_bytes(OWNED, orjson.dumps({**_record(store), kind: located}))


def add(store: Store, kind: str, urls: list[str], options: dict[str, Any] | None = None) -> None:
    """Recorded before they are written: a publish killed half-way leaves nothing a restart cannot find."""
    record(store, kind, [*owned(store, kind), *urls], options)


def is_owned(url: str, kind: str, store: Store, options: dict[str, Any] | None) -> bool:
    where = location(url, options)[:2]
    return any(location(u, options)[:2] == where for u in owned(store, kind))


def same_object(a: str, b: str, options: dict[str, Any]) -> bool:
    return location(a, options)[:2] == location(b, options)[:2]


def _remove(url: str, options: dict[str, Any]) -> bool:
    _, path, fs = location(url, options)
    if not fs.exists(path):
        return False
    fs.rm_file(path)
    return True


def discard(
    store: Store, options: dict[str, Any], dataset: str | None = None, keep: str | None = None
) -> list[str]:
    """Remove every object the output's record names, wherever it lives, the run's `dataset` (recorded in
    its identity), and what an output published before the record existed (its fixed names and Parquet
    shards); `keep`, the input, is never touched. Returns the URLs removed."""
    removed: list[str] = []
    found = [url for kind in KINDS for url in owned(store, kind)]
    for url in [*found, dataset] if dataset else found:
        if keep is not None and same_object(url, keep, options):
            continue
        if _remove(url, options):
            removed.append(url)
    store.delete(OWNED)
    for rel in UNRECORDED:
        if store.exists(rel):
            store.delete(rel)
            removed.append(store.url(rel))
    store.remove_stale_in("data", SHARD)
    for name in store.list("data"):
        if SHARD.match(name):
            store.delete(f"data/{name}")
            removed.append(store.url(f"data/{name}"))
    store.delete_tree(SHARD_MARKS)
    return removed
