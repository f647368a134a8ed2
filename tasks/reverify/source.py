"""What a reverify reads: a published dataset file, a run's Parquet shards (through the committed chunks
they were written from: tasks/reverify/shards.py), or (--failed-only) a collection's committed chunks and
their failures; planned once into chunks that end on task boundaries, so per-task statistics stay whole."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import fsspec

from rollflow.settings.reverify import VERIFY_FAILURE_KINDS
from rollflow.tasks.collect.rows import InputError, ScanStopped, open_checked, scan_checkpoint
from rollflow.tasks.storage import owned, rowjson
from rollflow.tasks.storage.ledger import Ledger
from rollflow.tasks.storage.rowjson import RolloutKey
from rollflow.tasks.storage.store import Store, describe_error, open_input, storage_options_for

DATASET_NAME = "rollouts.jsonl"

Mode = Literal["dataset", "shards", "failed"]


@dataclass(frozen=True)
class SourceChunk:
    """Rollouts `rows` of the source from line `first_line` (byte `byte_offset`), tasks first_task.. on.

    For a Parquet source and for --failed-only, `index` is the source's own chunk index and the offsets
    are unused; `sha256` is then that chunk object's, as its run committed it.
    """

    index: int
    first_task: int
    num_tasks: int
    rows: int
    byte_offset: int = 0
    first_line: int = 0
    sha256: str = ""  # of the chunk's rows as planned: a chunk reads exactly these or nothing


class SourceChanged(InputError):
    """The source no longer holds what the plan read: rescoring it would publish another dataset."""


@dataclass
class SourcePlan:
    url: str  # the dataset file, or the output folder for a Parquet source and --failed-only
    mode: Mode
    fingerprint: str
    rows: int
    tasks: int
    max_k: int  # most rollouts of one task: the pass@k the report can give
    chunks: list[SourceChunk]
    to_rescore: int


def _is_dir(url: str, options: dict[str, Any]) -> bool:
    fs, path = fsspec.core.url_to_fs(url, **storage_options_for(url, options, fresh=False))
    return bool(fs.isdir(path))


def dataset_file(url: str, options: dict[str, Any]) -> str | None:
    """The dataset a SOURCE names: the file itself, or a folder's rollouts.jsonl; None for a run's folder
    that published its dataset as Parquet shards (read by tasks/reverify/shards.py)."""
    try:
        folder = _is_dir(url, options)
        found = folder and Store(url, options).exists(DATASET_NAME)
    except Exception as exc:  # a store that cannot be reached or refuses the credentials
        problem = describe_error(url, exc)
        raise InputError(f"Source {url} cannot be read: {problem}. Nothing was rescored.") from exc
    if not folder:
        return url
    inner = f"{url.rstrip('/')}/{DATASET_NAME}"
    latest = _latest_dataset(url, options)  # a later publish elsewhere (--dataset) wins over a stale file
    if latest is not None:
        return latest
    if found:
        return inner
    return _published_elsewhere(url, options)


def _published(url: str, options: dict[str, Any]) -> str | None:
    """The dataset file the folder's record says its run published last (wherever --dataset put it:
    run.json keeps the URL as typed, relative to the folder it was run from, not to the output)."""
    store = Store(url, options)
    try:
        found = owned.published(store, owned.DATASET, options)
    except Exception:  # a record that cannot be read: the folder's own file, or the refusal below
        return None
    return found[-1] if found else None  # the record keeps publishing order: the last is the latest


def _latest_dataset(url: str, options: dict[str, Any]) -> str | None:
    """The dataset the folder's run published last, when it is not the folder's own rollouts.jsonl and
    is there; else None."""
    named = _published(url, options)
    if not named or owned.same_object(named, f"{url.rstrip('/')}/{DATASET_NAME}", options):
        return None
    try:
        return named if _exists(named, options) else None
    except Exception:  # a store that cannot be reached: the folder's own file, or the refusal below
        return None


def _published_elsewhere(url: str, options: dict[str, Any]) -> str | None:
    """A run's folder without rollouts.jsonl: the dataset it published elsewhere (--dataset, NeMo Gym's
    +output_jsonl_fpath), or None when it published Parquet shards."""
    store = Store(url, options)
    elsewhere = _published(url, options)
    if elsewhere is None and store.exists("run.json") and not owned.has_record(store):
        identity = Ledger(store).stored_identity()  # an output from before the record: run.json's URL
        elsewhere = identity.dataset_url if identity is not None else None
    if elsewhere and not owned.same_object(elsewhere, f"{url.rstrip('/')}/{DATASET_NAME}", options):
        try:
            if _exists(elsewhere, options):
                return elsewhere
        except Exception:
            pass
    if owned.owned(store, owned.SHARDS) or any(owned.SHARD.match(n) for n in store.list("data")):
        return None
    where = f" (the dataset it published, {elsewhere}, is not there)" if elsewhere else ""
    raise InputError(
        f"Source {url} is a folder without {DATASET_NAME}{where}: its run has not published a dataset. "
        "Pass the dataset file itself, or --failed-only to complete the run from its committed chunks."
    )


def _exists(url: str, options: dict[str, Any]) -> bool:
    fs, path = fsspec.core.url_to_fs(url, **storage_options_for(url, options, fresh=False))
    return bool(fs.exists(path))


@dataclass
class _Cutter:
    """Chunks of about `size` rollouts, closed only where the task index changes."""

    size: int
    chunks: list[SourceChunk]
    start: tuple[int, int, int] | None = None  # (first_task, byte_offset, first_line)
    rows: int = 0
    tasks: int = 0
    digest: Any = field(default_factory=hashlib.sha256)

    def close(self) -> None:
        if self.start is not None:
            first, offset, line = self.start
            sha = self.digest.hexdigest()
            self.chunks.append(SourceChunk(len(self.chunks), first, self.tasks, self.rows, offset, line, sha))
        self.start, self.rows, self.tasks, self.digest = None, 0, 0, hashlib.sha256()


def scan_dataset(
    url: str, chunk_size: int, options: dict[str, Any], stopped: Callable[[], bool] | None = None
) -> SourcePlan:
    """One streaming pass: fingerprint, count, check every line's key order, and cut the chunks.
    `stopped` is asked every STOP_EVERY lines (a scan runs on a thread, which a stopped run cannot cancel)."""
    digest = hashlib.sha256()
    cutter = _Cutter(chunk_size, [])
    offset = rows = tasks = max_k = run = 0
    last: RolloutKey = (-1, -1)
    with open_checked(url, options, what="Source", after="Nothing was rescored.") as fh:
        for lineno, line in enumerate(fh, start=1):
            scan_checkpoint(lineno, stopped, url)
            line_offset, offset = offset, offset + len(line)
            digest.update(line)
            if not line.strip():
                continue
            try:
                key = rowjson.read_keyed(line)[1]
            except rowjson.RowError as exc:
                raise InputError(
                    f"Source {url}, line {lineno}: not an output row of rollflow or NeMo Gym "
                    f"({exc.problem}). Each line must be a JSON object with _ng_task_index, "
                    f"_ng_rollout_index and response."
                ) from None
            if key <= last:
                raise InputError(
                    f"Source {url}, line {lineno}: rollout {key} comes after {last}; a published dataset is "
                    f"ordered by (task, rollout) with each once. Pass a dataset rollflow published."
                )
            if key[0] != last[0]:
                if cutter.rows >= chunk_size:
                    cutter.close()
                tasks += 1
                cutter.tasks += 1
                run = 0
            if cutter.start is None:
                cutter.start = (key[0], line_offset, lineno)
            run += 1
            max_k = max(max_k, run)
            cutter.digest.update(line.rstrip(b"\r\n") + b"\n")
            cutter.rows += 1
            rows += 1
            last = key
    cutter.close()
    if rows == 0:
        raise InputError(f"Source {url} holds no rollouts: there is nothing to rescore.")
    return SourcePlan(url, "dataset", digest.hexdigest(), rows, tasks, max_k, cutter.chunks, rows)


def read_dataset_chunk(url: str, chunk: SourceChunk, options: dict[str, Any]) -> list[bytes]:
    """The chunk's rows (without newline), read from its byte offset and checked against the plan: a
    source rewritten since (a collection re-run over it) is refused, never rescored as if planned."""
    rows: list[bytes] = []
    digest = hashlib.sha256()
    with open_input(url, options, offset=chunk.byte_offset) as fh:  # skips on a Range-less HTTP server
        for line in fh:
            if len(rows) == chunk.rows:
                break
            if line.strip():
                row = line.rstrip(b"\r\n")
                digest.update(row + b"\n")
                rows.append(row)
    if len(rows) != chunk.rows or (chunk.sha256 and digest.hexdigest() != chunk.sha256):
        raise SourceChanged(
            f"Source {url} changed after this reverify planned it: chunk {chunk.index} (line "
            f"{chunk.first_line} on, {chunk.rows:,} rollouts) no longer holds the rows planned. Nothing "
            f"was published. Run again with --restart to rescore what the source holds now."
        )
    return rows


def is_rescorable(record: dict[str, Any]) -> bool:
    """A failure line of a verification failure that kept its reply (the response to score again)."""
    kind = (record.get("error") or {}).get("kind")
    return kind in VERIFY_FAILURE_KINDS and isinstance(record.get("output"), dict)


def scan_failed(url: str, options: dict[str, Any], stopped: Callable[[], bool] | None = None) -> SourcePlan:
    """--failed-only: the source output's chunk plan; every chunk must be committed (else collect first).
    `stopped` is asked before each chunk's failures are read."""
    ledger = Ledger(Store(url, options))
    identity = ledger.stored_identity()
    if identity is None:
        raise InputError(
            f"Source {url} is not a rollflow output folder (no run.json), which --failed-only needs: it "
            f"reads the committed chunks and their failures. Pass the folder given as --output when "
            f"collecting."
        )
    committed = ledger.committed()
    missing = [c["index"] for c in identity.chunks if c["index"] not in committed]
    if missing:
        raise InputError(
            f"Source {url}: chunks {missing[:10]} are not committed, so the dataset cannot be completed. "
            f"Run the collection's command again to collect them first."
        )
    digest = hashlib.sha256(identity.run_id.encode())
    chunks, to_rescore, rows = [], 0, 0
    for spec in identity.chunks:
        if stopped is not None and stopped():
            raise ScanStopped(f"the scan of {url} was stopped at chunk {spec['index']}")
        manifest = committed[spec["index"]]
        digest.update(manifest.sha256.encode())
        fails = _failure_records(ledger, spec["index"]) if manifest.failed else []
        for lineno, raw in enumerate(fails, start=1):
            digest.update(raw)
            record = _record(url, ledger.failures_path(spec["index"]), lineno, raw, InputError)[0]
            to_rescore += is_rescorable(record)
        rows += manifest.rows + manifest.failed
        chunks.append(
            SourceChunk(
                spec["index"], spec["first_task"], spec["num_tasks"], manifest.rows + manifest.failed,
                sha256=manifest.sha256,
            )
        )  # fmt: skip
    return SourcePlan(
        url, "failed", digest.hexdigest(), rows, identity.tasks, identity.num_repeats, chunks, to_rescore
    )


def _failure_records(ledger: Ledger, chunk: int) -> list[bytes]:
    rel = ledger.failures_path(chunk)
    if not ledger.store.exists(rel):
        return []
    return [line for line in ledger.store.read_bytes(rel).splitlines() if line.strip()]


def _record(
    url: str, rel: str, lineno: int, raw: bytes, error: type[InputError]
) -> tuple[dict[str, Any], RolloutKey]:
    """A failure record of the source and its rollout, or `error` naming its file and line."""
    try:
        return rowjson.read_keyed(raw)
    except rowjson.RowError as exc:
        raise error(
            f"Source {url}, {rel} line {lineno}: not a failure record ({exc.problem}). A run's failures are "
            f"written by rollflow and never edited; collect again, or reverify the published dataset instead "
            f"of completing it. Nothing was published."
        ) from None


def iter_failed_chunk(url: str, chunk: SourceChunk, options: dict[str, Any]) -> Iterator[tuple[bytes, bool]]:
    """(line, is a failure record) of a source chunk, ordered by (task, rollout): its committed rows, checked
    against the hash its run committed them with, and its failures, merged."""
    ledger = Ledger(Store(url, options))
    digest = hashlib.sha256()
    with ledger.open_chunk(chunk.index) as fh:
        data = fh.read()
    digest.update(data)
    if chunk.sha256 and digest.hexdigest() != chunk.sha256:
        raise SourceChanged(
            f"Source {url}: chunk {chunk.index}'s rows are not those its run committed (its data, or the "
            f"published dataset that holds it, was edited since). Nothing was published. Collect the source "
            f"again (the same command redoes that chunk), then complete it."
        )
    rows = [line.rstrip(b"\r\n") for line in data.splitlines() if line.strip()]
    fails = _failure_records(ledger, chunk.index)
    rel = ledger.failures_path(chunk.index)
    keyed = [(rowjson.read_keyed(line)[1], line, False) for line in rows]
    for lineno, raw in enumerate(fails, start=1):
        keyed.append((_record(url, rel, lineno, raw, SourceChanged)[1], raw, True))
    keyed.sort(key=lambda item: item[0])
    for _, line, failed in keyed:
        yield line, failed


def rescorable_keys(url: str, chunk: SourceChunk, options: dict[str, Any]) -> set[RolloutKey]:
    """--failed-only: the rollouts of a source chunk this run scores (its rescorable failures)."""
    records = (rowjson.read_row(raw) for raw in _failure_records(Ledger(Store(url, options)), chunk.index))
    return {rowjson.rollout_key(r) for r in records if is_rescorable(r)}
