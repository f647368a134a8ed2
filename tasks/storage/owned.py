"""What a run owns: one record, `published.json` in the output, of every object its publish wrote.

Each object is recorded before it is written, by its path relative to the output (`data/x.parquet`, or
`../results.jsonl` beside it) when both are on one store, so a moved or copied folder names its own files;
its size is recorded once the publish is done. A restart removes what is recorded, and only while it is
still what was published (the size it had): a user's file that took its place is never deleted. Every new
run starts the record, so an output with a record trusts nothing else.

An object outside the output is also recorded where it was (`at`) and by which folder (`by`): a copy or a
moved folder still finds it, but only the folder that published it removes it (a copy's restart would
otherwise delete the original's dataset).
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
# rollflow's fixed names in its output (and what an output from before the record held): replacing a run
# removes them.
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


def has_record(store: Store) -> bool:
    """Whether the output keeps a record (every run started since it existed does)."""
    return store.exists(OWNED)


def start_record(store: Store) -> None:
    """A new run's empty record: from now on only what it names is this output's."""
    if not store.exists(OWNED):
        store.write_bytes(OWNED, b"{}")


def _read(store: Store) -> dict[str, list[dict[str, Any]]]:
    try:
        found = orjson.loads(store.read_bytes(OWNED))
    except (FileNotFoundError, ValueError):
        return {}
    if not isinstance(found, dict):
        return {}
    # a record written before sizes were kept lists bare paths
    return {
        kind: [e if isinstance(e, dict) else {"path": e, "size": None} for e in entries]
        for kind, entries in found.items()
        if isinstance(entries, list)
    }


def _write(store: Store, record: dict[str, list[dict[str, Any]]]) -> None:
    store.write_bytes(OWNED, orjson.dumps(record))


def _protocol(store: Store) -> str:
    return store.fs.protocol if isinstance(store.fs.protocol, str) else store.fs.protocol[0]


def resolved(store: Store, recorded: str) -> str:
    return recorded if recorded.startswith("/") or "://" in recorded else store.url(recorded)


def recorded(store: Store, url: str, options: dict[str, Any] | None) -> str:
    """Relative to the output when on its store (`../x.jsonl` beside it), else where it is."""
    protocol, path, _ = location(url, options)
    root = posixpath.normpath(store.root)
    same_store = protocol in ("file", "local") or path.split("/")[0] == root.split("/")[0]  # one bucket
    if protocol == _protocol(store) and same_store:
        return posixpath.relpath(path, root)
    return path if protocol in ("file", "local") else f"{protocol}://{path}"


def owned(store: Store, kind: str) -> list[str]:
    """The URLs of one kind of object this output published, from its record."""
    return [resolved(store, e["path"]) for e in _read(store).get(kind, [])]


def published(store: Store, kind: str, options: dict[str, Any] | None = None) -> list[str]:
    """Where each object of `kind` is now: beside the output as recorded, else where it was published
    (a folder moved without the dataset it published beside it)."""
    return [_found(store, e, options) for e in _read(store).get(kind, [])]


def locate(store: Store, path: str, at: str | None, options: dict[str, Any] | None = None) -> str:
    """A path recorded relative to the output, and where it was then (`at`), as it is now: see
    `published`."""
    return _found(store, {"path": path, "at": at}, options)


def _found(store: Store, entry: dict[str, Any], options: dict[str, Any] | None) -> str:
    here = resolved(store, entry["path"])
    at = entry.get("at")
    if not at or at == here or _exists(here, options) or not _exists(at, options):
        return here
    return at


def _exists(url: str, options: dict[str, Any] | None) -> bool:
    try:
        _, path, fs = location(url, options)
        return bool(fs.exists(path))
    except (OSError, ValueError):
        return False


def record(store: Store, kind: str, urls: list[str], options: dict[str, Any] | None = None) -> None:
    """The objects of `kind` this output owns from now on (replacing the kind's earlier list)."""
    found = _read(store)
    sizes = {e["path"]: e.get("size") for e in found.get(kind, [])}
    by = absolute_url(store.root_url, store.options)
    entries: dict[str, dict[str, Any]] = {}
    for url in urls:
        path = recorded(store, url, options)
        entry: dict[str, Any] = {"path": path, "size": sizes.get(path)}
        if _outside(path):
            entry |= {"at": absolute_url(url, options), "by": by}
        entries[path] = entry
    _write(store, {**found, kind: list(entries.values())})


def add(store: Store, kind: str, urls: list[str], options: dict[str, Any] | None = None) -> None:
    """Recorded before they are written: a publish killed half-way leaves nothing a restart cannot find.
    The record keeps the order they were published in: the last is the latest."""
    earlier = [
        u for u in published(store, kind, options) if not any(same_object(u, n, options or {}) for n in urls)
    ]
    record(store, kind, [*earlier, *urls], options)


def settle(store: Store, options: dict[str, Any] | None = None) -> None:
    """Once the publish is done: the size of each object recorded outside the output, so a later restart
    can tell it from a file that took its place."""
    found = _read(store)
    for entries in found.values():
        for entry in (e for e in entries if _outside(e["path"])):
            entry["size"] = _size(_found(store, entry, options), options)
    _write(store, found)


def is_owned(url: str, kind: str, store: Store, options: dict[str, Any] | None) -> bool:
    """Whether `url` is an object of `kind` this output published: where its record puts it, or where it
    was published while it keeps the size it was published at (the output has moved since)."""
    where = location(url, options)[:2]
    for entry in _read(store).get(kind, []):
        if location(resolved(store, entry["path"]), options)[:2] == where:
            return True
        if entry.get("at") and location(entry["at"], options)[:2] == where:
            size = entry.get("size")
            if size is None or _size(url, options) == size:
                return True
    return False


def _size(url: str, options: dict[str, Any] | None) -> int | None:
    try:
        _, path, fs = location(url, options)
        return int(fs.size(path))
    except (OSError, ValueError, TypeError):
        return None


def same_object(a: str, b: str, options: dict[str, Any]) -> bool:
    return location(a, options)[:2] == location(b, options)[:2]


def _outside(recorded: str) -> bool:
    return recorded.startswith(("/", "../")) or "://" in recorded or recorded == ".."


def _remove(url: str, options: dict[str, Any], size: int | None) -> bool:
    """Delete the object if it is still the one published (its recorded size, when recorded)."""
    _, path, fs = location(url, options)
    try:
        if not fs.exists(path) or (size is not None and int(fs.size(path)) != size):
            return False
    except (FileNotFoundError, OSError):
        return False
    fs.rm_file(path)
    return True


def discard(
    store: Store, options: dict[str, Any], dataset: str | None = None, keep: str | None = None
) -> list[str]:
    """Remove every object the output's record names that is still as published, wherever it lives, and
    rollflow's fixed names and Parquet shards in the output; for an output from before the record, its
    `dataset` too (an absolute path). `keep`, the input, is never touched. Returns the URLs removed."""
    legacy = not has_record(store)
    here = absolute_url(store.root_url, store.options)
    entries = [e for kind in KINDS for e in _read(store).get(kind, [])]
    # inside the output (rollflow's own folder) always; outside only while it is the size it was published
    # and only by the folder that published it (not a copy of it, nor the folder moved)
    found = [
        (
            e["at"] if e.get("at") else resolved(store, e["path"]),
            e.get("size") if _outside(e["path"]) else None,
        )
        for e in entries
        if not _outside(e["path"]) or e.get("by", here) == here
    ]
    if legacy and dataset and (dataset.startswith("/") or "://" in dataset):
        found.append((dataset, None))
    removed: list[str] = []
    for url, size in found:
        if keep is not None and same_object(url, keep, options):
            continue
        if _remove(url, options, size):
            removed.append(url)
    store.delete(OWNED)
    removed += _discard_unrecorded(store)  # rollflow's own names in its own folder, recorded or not
    store.remove_stale_in("data", SHARD)  # partial shard copies a killed publish left
    store.delete_tree(SHARD_MARKS)
    return removed


def _discard_unrecorded(store: Store) -> list[str]:
    removed = [store.url(rel) for rel in UNRECORDED if store.exists(rel)]
    for rel in UNRECORDED:
        store.delete(rel)
    for name in store.list("data"):
        if SHARD.match(name):
            store.delete(f"data/{name}")
            removed.append(store.url(f"data/{name}"))
    return removed
