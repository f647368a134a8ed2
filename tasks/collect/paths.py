"""Where a run reads and writes, checked before the first request: the input is never under the output
(the dataset or a --restart would overwrite or delete it), the dataset path names an object, and the
per-task file and the dataset card published beside the dataset are named after it (unless the folder is the
output's own) and never replace a file of the user's."""

from __future__ import annotations

import posixpath
from typing import Any

from rollflow.tasks.collect.rows import InputError
from rollflow.tasks.storage.ledger import Ledger
from rollflow.tasks.storage.owned import (
    CARDS,
    DATASET,
    TASKS,
    UNRECORDED,
    has_record,
    is_owned,
    location,
    same_object,
)
from rollflow.tasks.storage.store import Store

TASKS_SUFFIX = ".tasks.jsonl"  # per-task reward lines, published beside the dataset
CARD = "README.md"  # the dataset card in the output's own folder, where Hugging Face reads it
CARD_SUFFIX = ".README.md"  # the dataset card of a dataset in a folder the output does not own


def _beside(dataset_url: str, suffix: str) -> str:
    parent, name = posixpath.split(dataset_url.rstrip("/"))
    stem = name[: -len(".jsonl")] if name.endswith(".jsonl") else name
    return posixpath.join(parent, stem + suffix) if parent else stem + suffix


def tasks_url(dataset_url: str) -> str:
    """`results/math.jsonl` -> `results/math.tasks.jsonl`: two datasets in one folder keep their own."""
    return _beside(dataset_url, TASKS_SUFFIX)


def sidecar_url(dataset_url: str) -> str:
    """`out/rollouts.jsonl` -> `out/rollouts_failures.jsonl` (NeMo Gym's failures_path_for)."""
    return _stem(dataset_url) + "_failures.jsonl"


def metrics_url(dataset_url: str) -> str:
    """`out/rollouts.jsonl` -> `out/rollouts_aggregate_metrics.json` (as NeMo Gym names it)."""
    return _stem(dataset_url) + "_aggregate_metrics.json"


def _stem(url: str) -> str:
    root, ext = posixpath.splitext(url)
    return root if ext else url


def card_url(published_url: str, output_url: str) -> str:
    """`OUT/rollouts.jsonl` or `OUT/data` -> `OUT/README.md` (the folder is the output's own); a dataset
    elsewhere, `results/math.jsonl` -> `results/math.README.md`, so shared folders keep each card and
    a user's README.md."""
    if in_output_folder(published_url, output_url):
        return posixpath.join(posixpath.split(published_url.rstrip("/"))[0] or ".", CARD)
    return _beside(published_url, CARD_SUFFIX)


def in_output_folder(url: str, output_url: str) -> bool:
    """Whether `url` lies directly in the output's own folder (not beside it in a shared one)."""
    parent = posixpath.split(url.rstrip("/"))[0] or "."
    return posixpath.normpath(parent) == posixpath.normpath(output_url.rstrip("/") or "/")


def owns_card_folder(card: str) -> bool:
    """Whether the card is the output's own README.md (rewritten freely) rather than one beside a dataset."""
    return posixpath.basename(card) == CARD


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
    _check_dataset_owned(dataset_url, output_url, dataset_options, store, ds_fs.exists(dataset))
    _check_fresh_output(store)
    for name, published in (("failures sidecar", sidecar_url), ("aggregate metrics", metrics_url)):
        if location(published(dataset_url), dataset_options)[:2] == (where, inp):
            raise InputError(
                f"The input {input_url} is where the run publishes NeMo Gym's {name} beside the dataset "
                f"{dataset_url}; publishing would overwrite it. Copy the input elsewhere first (to collect "
                f"the failures again, copy them out), or choose another dataset path. No request was sent."
            )
    beside = tasks_url(dataset_url)
    _check_beside(input_url, beside, TASKS, (where, inp), dataset_options, store, dataset_url)
    if card is not None and not owns_card_folder(card):  # the output's own README.md is rewritten freely
        _check_beside(input_url, card, CARDS, (where, inp), dataset_options, store, dataset_url)


def _check_fresh_output(store: Store) -> None:
    """A folder that never held a run keeps its own files: a user's README.md or report.md there was
    replaced by the card and the report without a word."""
    if store.exists("run.json") or has_record(store):
        return
    found = [name for name in UNRECORDED if store.exists(name)]  # a run's fixed names in its output
    if found:
        raise InputError(
            f"The output {store.root_url} holds {', '.join(found)}, which no rollflow run wrote there; the "
            f"run writes its card and report under those names and never replaces a file it did not write. "
            f"Move {'it' if len(found) == 1 else 'them'}, or choose another --output. No request was sent."
        )


def _check_dataset_owned(
    dataset_url: str, output_url: str, options: dict[str, Any], store: Store, exists: bool
) -> None:
    """A dataset file outside the output is replaced only when this output wrote it (NeMo Gym's own
    output, or a user's file, is never overwritten)."""
    if (
        not exists
        or in_output_folder(dataset_url, output_url)
        or is_owned(dataset_url, DATASET, store, options)
    ):
        return
    stored = None if has_record(store) else Ledger(store).stored_identity()
    if stored is not None and stored.dataset_url and same_object(stored.dataset_url, dataset_url, options):
        return  # an output from before the record of what it owns published it
    raise InputError(
        f"The dataset path {dataset_url} exists and was not written by this output ({store.root_url}); "
        f"rollflow never replaces a file it did not write (it resumes from its own output, not from a file "
        f"another tool wrote there). Move that file, or choose another dataset path. No request was sent."
    )


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
    if fs.exists(path) and not is_owned(beside, kind, store, options):
        raise InputError(
            f"{beside} exists and was not written by this output ({store.root_url}); the run publishes "
            f"its {lines} there, beside the dataset {dataset_url}, and never replaces a "
            f"file it did not write. Move that file, or choose another dataset path. No request was sent."
        )
