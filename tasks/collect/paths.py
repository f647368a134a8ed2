"""Where a run reads and writes, checked before the first request: the input is never under the output
(the dataset or a --restart would overwrite or delete it), the dataset path names an object, and the
per-task file and the dataset card published beside the dataset are named after it (unless the folder is the
output's own) and never replace a file of the user's."""

from __future__ import annotations

import posixpath
import re
from typing import Any

import fsspec
import orjson

from rollflow.tasks.collect.rows import InputError
from rollflow.tasks.storage.store import Store, storage_options_for

TASKS_SUFFIX = ".tasks.jsonl"  # per-task reward lines, published beside the dataset
PUBLISHED = (
    "published.json"  # in the output: the files this output wrote beside the dataset (only they are removed)
)
CARD = "README.md"  # the dataset card in the output's own folder, where Hugging Face reads it
CARD_SUFFIX = ".README.md"  # the dataset card of a dataset in a folder the output does not own


def _beside(dataset_url: str, suffix: str) -> str:
    parent, name = posixpath.split(dataset_url.rstrip("/"))
    stem = name[: -len(".jsonl")] if name.endswith(".jsonl") else name
    return posixpath.join(parent, stem + suffix) if parent else stem + suffix


def tasks_url(dataset_url: str) -> str:
    """`results/math.jsonl` -> `results/math.tasks.jsonl`: two datasets in one folder keep their own."""
    return _beside(dataset_url, TASKS_SUFFIX)


def card_url(published_url: str, output_url: str) -> str:
    """`OUT/rollouts.jsonl` or `OUT/data` -> `OUT/README.md` (the folder is the output's own); a dataset
    elsewhere, `results/math.jsonl` -> `results/math.README.md`, so shared folders keep each card and
    a user's README.md."""
    parent = posixpath.split(published_url.rstrip("/"))[0] or "."
    if posixpath.normpath(parent) == posixpath.normpath(output_url.rstrip("/") or "/"):
        return posixpath.join(parent, CARD)
    return _beside(published_url, CARD_SUFFIX)


def owns_card_folder(card: str) -> bool:
    """Whether the card is the output's own README.md (rewritten freely) rather than one beside a dataset."""
    return posixpath.basename(card) == CARD


def location(url: str, options: dict[str, Any] | None) -> tuple[str, str, Any]:
    """(protocol, normalised path, filesystem): two URLs name one object when the first two are equal."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options_for(url, options, fresh=False))
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol, posixpath.normpath(fs._strip_protocol(path)), fs


def _published(store: Store) -> dict[str, Any]:
    try:
        record = orjson.loads(store.read_bytes(PUBLISHED))
    except (FileNotFoundError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def absolute_url(url: str, options: dict[str, Any] | None) -> str:
    """The URL as a location: `out/x` and `./out/x` typed in any folder name one file, recorded once."""
    protocol, path, _ = location(url, options)
    return path if protocol in ("file", "local") else f"{protocol}://{path}"


def _owned(url: str, urls: list[str], options: dict[str, Any] | None) -> bool:
    where = location(url, options)[:2]
    return any(location(u, options)[:2] == where for u in urls)


def published_files(store: Store, kind: str) -> list[str]:
    """The files of one kind (`tasks`, `cards`) this output published (URLs), from its own record; one
    inside the output is recorded relative to it, so a moved or copied output folder is still itself."""
    return [_resolved(store, u) for u in _published(store).get(kind, [])]


def _resolved(store: Store, recorded: str) -> str:
    if recorded.startswith("/") or "://" in recorded:
        return recorded
    return store.url(recorded)


def _recorded(store: Store, url: str, options: dict[str, Any] | None) -> str:
    """Where a published file is recorded: relative to the output when inside it, else where it is."""
    located = absolute_url(url, options)
    protocol = store.fs.protocol if isinstance(store.fs.protocol, str) else store.fs.protocol[0]
    root = posixpath.normpath(store.root)
    root = root if protocol in ("file", "local") else f"{protocol}://{root}"
    prefix = root.rstrip("/") + "/"
    return located[len(prefix) :] if located.startswith(prefix) else located


def record_files(store: Store, kind: str, urls: list[str], options: dict[str, Any] | None = None) -> None:
    located = sorted({_recorded(store, u, options) for u in urls})
    store.write_bytes(PUBLISHED, orjson.dumps({**_published(store), kind: located}))


def published_tasks(store: Store) -> list[str]:
    return published_files(store, "tasks")


def record_tasks(store: Store, urls: list[str], options: dict[str, Any] | None = None) -> None:
    record_files(store, "tasks", urls, options)


def check_paths(
    input_url: str,
    output_url: str,
    dataset_url: str,
    options: tuple[dict[str, Any], dict[str, Any]],
    store: Store,
    card: str | None = None,
) -> None:
    """Refuse (InputError, exit 2) an input inside the output, a dataset path that is not an object, or a
    per-task file or card (`card`) beside the dataset that would replace a file this output did not write."""
    input_options, dataset_options = options
    where, inp, _ = location(input_url, input_options)
    out_where, out = store.fs.protocol, posixpath.normpath(store.root)
    out_where = out_where if isinstance(out_where, str) else out_where[0]
    if where == out_where and (inp == out or inp.startswith(out.rstrip("/") + "/")):
        raise InputError(
            f"Input {input_url} is inside the output directory {output_url}, where the run writes and "
            f"--restart deletes. Move the input out of it, or choose another --output. No request was sent."
        )
    ds_where, dataset, ds_fs = location(dataset_url, dataset_options)
    if ds_where == where and dataset == inp:
        raise InputError(
            f"The dataset path {dataset_url} is the input file; publishing would overwrite it. Choose "
            f"another dataset path. No request was sent."
        )
    if ds_fs.isdir(dataset):
        raise InputError(
            f"The dataset path {dataset_url} is a directory; it must name a file (e.g. "
            f"{dataset_url.rstrip('/')}/rollouts.jsonl). No request was sent."
        )
    beside = tasks_url(dataset_url)
    _check_beside(input_url, beside, "tasks", (where, inp), dataset_options, store, dataset_url)
    if card is not None and not owns_card_folder(card):  # the output's own README.md is rewritten freely
        _check_beside(input_url, card, "cards", (where, inp), dataset_options, store, dataset_url)


_WHAT = {"tasks": ("per-task file", "per-task reward lines"), "cards": ("dataset card", "dataset card")}


def _check_beside(
    input_url: str,
    beside: str,
    kind: str,
    inp: tuple[str, str],
    options: dict[str, Any],
    store: Store,
    dataset_url: str,
) -> None:
    """A file published beside the dataset may replace only a file this output published itself."""
    name, lines = _WHAT[kind]
    where, path, fs = location(beside, options)
    if (where, path) == inp:
        raise InputError(
            f"The input {input_url} is where the run publishes its {name} {beside} beside the "
            f"dataset {dataset_url}; publishing would overwrite it. Choose another dataset path or rename "
            f"the input. No request was sent."
        )
    if fs.exists(path) and not _owned(beside, published_files(store, kind), options):
        raise InputError(
            f"{beside} exists and was not written by this output ({store.root_url}); the run publishes "
            f"its {lines} there, beside the dataset {dataset_url}, and never replaces a "
            f"file it did not write. Move that file, or choose another dataset path. No request was sent."
        )


def _remove(url: str, options: dict[str, Any]) -> None:
    _, path, fs = location(url, options)
    if fs.exists(path):
        fs.rm_file(path)


def same_object(a: str, b: str, options: dict[str, Any]) -> bool:
    return location(a, options)[:2] == location(b, options)[:2]


def remove_published(dataset_url: str, options: dict[str, Any], store: Store) -> bool:
    """Delete the dataset a discarded run published (--restart), and its per-task file and card when this
    output wrote them, wherever they live; whether the dataset was there. No other file is touched."""
    _, path, fs = location(dataset_url, options)
    beside = tasks_url(dataset_url)
    ours = published_tasks(store)
    if _owned(beside, ours, options):
        _remove(beside, options)
        record_tasks(store, [u for u in ours if not _owned(u, [beside], options)], options)
    for kind in ("cards", "nemo_gym"):  # the card, and NeMo Gym's sidecar and metrics files
        found = published_files(store, kind)
        for url in found:
            _remove(url, options)
        if found:
            record_files(store, kind, [])
    if not fs.exists(path):
        return False
    fs.rm_file(path)
    return True


SHARD = re.compile(r"^train-\d{5}-of-\d{5}\.parquet$")  # the Parquet shards rollflow writes
SHARD_MARKS = "parquet"  # their markers, in the output


def remove_output_dataset(store: Store) -> None:
    """What a discarded run published inside its output: its Parquet shards (and their markers and dead
    partial copies) and the output's own card. A user's other files there are left alone."""
    store.remove_stale_in("data", SHARD)
    for name in store.list("data"):
        if SHARD.match(name):
            store.delete(f"data/{name}")
    store.delete_tree(SHARD_MARKS)
    store.delete(CARD)
