"""Where a run reads and writes, checked before the first request: the input is never under the output
(the dataset or a --restart would overwrite or delete it), the dataset path names an object, and the
per-task file published beside the dataset is named after it and never replaces a file of the user's."""

from __future__ import annotations

import posixpath
from typing import Any

import fsspec
import orjson

from rollflow.tasks.collect.rows import InputError
from rollflow.tasks.storage.store import Store, storage_options_for

TASKS_SUFFIX = ".tasks.jsonl"  # per-task reward lines, published beside the dataset
PUBLISHED = "published.json"  # in the output: the per-task files this output wrote (so only they are removed)


def tasks_url(dataset_url: str) -> str:
    """`results/math.jsonl` -> `results/math.tasks.jsonl`: two datasets in one folder keep their own."""
    parent, name = posixpath.split(dataset_url.rstrip("/"))
    stem = name[: -len(".jsonl")] if name.endswith(".jsonl") else name
    return posixpath.join(parent, stem + TASKS_SUFFIX) if parent else stem + TASKS_SUFFIX


def _location(url: str, options: dict[str, Any] | None) -> tuple[str, str, Any]:
    fs, path = fsspec.core.url_to_fs(url, **storage_options_for(url, options, fresh=False))
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol, posixpath.normpath(fs._strip_protocol(path)), fs


def published_tasks(store: Store) -> list[str]:
    """The per-task files this output published (URLs), from its own record."""
    try:
        return list(orjson.loads(store.read_bytes(PUBLISHED)).get("tasks", []))
    except (FileNotFoundError, ValueError):
        return []


def record_tasks(store: Store, urls: list[str]) -> None:
    store.write_bytes(PUBLISHED, orjson.dumps({"tasks": sorted(set(urls))}))


def check_paths(
    input_url: str,
    output_url: str,
    dataset_url: str,
    options: tuple[dict[str, Any], dict[str, Any]],
    store: Store,
) -> None:
    """Refuse (InputError, exit 2) an input inside the output, or a dataset path that is not an object."""
    input_options, dataset_options = options
    where, inp, _ = _location(input_url, input_options)
    out_where, out = store.fs.protocol, posixpath.normpath(store.root)
    out_where = out_where if isinstance(out_where, str) else out_where[0]
    if where == out_where and (inp == out or inp.startswith(out.rstrip("/") + "/")):
        raise InputError(
            f"Input {input_url} is inside the output directory {output_url}, where the run writes and "
            f"--restart deletes. Move the input out of it, or choose another --output. No request was sent."
        )
    ds_where, dataset, ds_fs = _location(dataset_url, dataset_options)
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
    _check_tasks_path(input_url, dataset_url, (where, inp), dataset_options, store)


def _check_tasks_path(
    input_url: str, dataset_url: str, inp: tuple[str, str], options: dict[str, Any], store: Store
) -> None:
    """The per-task file beside the dataset may replace only a file this output published itself."""
    beside = tasks_url(dataset_url)
    where, path, fs = _location(beside, options)
    if (where, path) == inp:
        raise InputError(
            f"The input {input_url} is where the run publishes its per-task file {beside} beside the "
            f"dataset {dataset_url}; publishing would overwrite it. Choose another dataset path or rename "
            f"the input. No request was sent."
        )
    if fs.exists(path) and beside not in published_tasks(store):
        raise InputError(
            f"{beside} exists and was not written by this output ({store.root_url}); the run publishes "
            f"its per-task reward lines there, beside the dataset {dataset_url}, and never replaces a "
            f"file it did not write. Move that file, or choose another dataset path. No request was sent."
        )


def same_object(a: str, b: str, options: dict[str, Any]) -> bool:
    return _location(a, options)[:2] == _location(b, options)[:2]


def remove_published(dataset_url: str, options: dict[str, Any], store: Store) -> bool:
    """Delete the dataset a discarded run published (--restart), and its per-task file when this output
    wrote it, wherever they live; whether the dataset was there. No other file is touched."""
    _, path, fs = _location(dataset_url, options)
    beside = tasks_url(dataset_url)
    ours = published_tasks(store)
    if beside in ours:
        _, tasks_path, tasks_fs = _location(beside, options)
        if tasks_fs.exists(tasks_path):
            tasks_fs.rm_file(tasks_path)
        record_tasks(store, [u for u in ours if u != beside])
    if not fs.exists(path):
        return False
    fs.rm_file(path)
    return True
