"""Where a run reads and writes, checked before the first request: the input is never under the output
(the dataset or a --restart would overwrite or delete it) and the dataset path names an object."""

from __future__ import annotations

import posixpath
from typing import Any

import fsspec

from rollflow.tasks.collect.rows import InputError
from rollflow.tasks.storage.store import Store, storage_options_for


def _location(url: str, options: dict[str, Any] | None) -> tuple[str, str, Any]:
    fs, path = fsspec.core.url_to_fs(url, **storage_options_for(url, options, fresh=False))
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol, posixpath.normpath(fs._strip_protocol(path)), fs


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
    if ds_where == where and posixpath.join(posixpath.dirname(dataset), TASKS_NAME) == inp:
        raise InputError(
            f"The input {input_url} is where the run publishes {TASKS_NAME} beside the dataset "
            f"{dataset_url}; publishing would overwrite it. Choose another dataset path or rename the "
            f"input. No request was sent."
        )
    if ds_fs.isdir(dataset):
        raise InputError(
            f"The dataset path {dataset_url} is a directory; it must name a file (e.g. "
            f"{dataset_url.rstrip('/')}/rollouts.jsonl). No request was sent."
        )


TASKS_NAME = "tasks.jsonl"  # per-task reward lines, published beside the dataset


def same_object(a: str, b: str, options: dict[str, Any]) -> bool:
    return _location(a, options)[:2] == _location(b, options)[:2]


def remove_published(dataset_url: str, options: dict[str, Any]) -> bool:
    """Delete the dataset a discarded run published (--restart), and the tasks.jsonl beside it, wherever
    they live; whether the dataset was there."""
    _, path, fs = _location(dataset_url, options)
    beside = posixpath.join(posixpath.dirname(path), TASKS_NAME)
    if fs.exists(beside):
        fs.rm_file(beside)
    if not fs.exists(path):
        return False
    fs.rm_file(path)
    return True
