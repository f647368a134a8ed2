"""A run's Parquet shards as a reverify source, read through the committed chunks they were written from.

A shard stores values, not lines: key order, an absent key against a null, `1` against `1.0` in a float
column are gone. The chunk objects are the exact rows (collection keeps them for a Parquet output), so the
plan reads those: every shard the output's record names, with the chunks its marker lists, is checked
against them row for row (each chunk's bytes hashed against the marker, its rows read with rowjson and
converted as a shard stores them, the dataset's schema found again). A shard and its chunks that disagree,
or chunk data that is gone, is refused: only what was published is rescored. The fingerprint is the
sha256 of those rows as JSONL, which is the sha256 of the rollouts.jsonl the same run would publish.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from rollflow.tasks.collect.rows import InputError, scan_checkpoint
from rollflow.tasks.publish.parquet import BATCH_ROWS, add_columns, dataset_schema, shard_name, to_batch
from rollflow.tasks.reverify.source import SourceChanged, SourceChunk, SourcePlan
from rollflow.tasks.storage import owned, rowjson
from rollflow.tasks.storage.ledger import Ledger
from rollflow.tasks.storage.rowjson import RolloutKey
from rollflow.tasks.storage.store import Store

DATA = "data"


class ShardsDisagree(InputError):
    """The published shards are not the committed chunks they were written from (or those are gone)."""


def _refuse(url: str, what: str, shard: str | None = None) -> ShardsDisagree:
    """`shard`: the shard at fault, which a collection run again keeps while its marker matches."""
    fix = (
        f"Remove {url.rstrip('/')}/{DATA}/{shard} and run the collection's command on {url} again (it writes "
        f"the shard again from its committed chunks)"
        if shard
        else f"Run the collection's command on {url} again (it collects again any chunk whose data is gone "
        f"or changed, and publishes the shards again from its committed chunks)"
    )
    return ShardsDisagree(
        f"Source {url} published its dataset as Parquet shards ({url.rstrip('/')}/{DATA}/), which reverify "
        f"reads through the committed chunks they were written from, but {what}. Nothing was rescored. "
        f"{fix}, then run this reverify again."
    )


def _shard_names(url: str, store: Store) -> list[str]:
    """The shards the output's record says its run published (all under data/), in order."""
    recorded = owned.owned(store, owned.SHARDS)
    listed = [n for n in store.list(DATA) if owned.SHARD.match(n)]
    if not recorded:
        if listed:
            raise _refuse(url, "its published.json names no shards (an output from before the record)")
        raise _refuse(url, f"no shard is left in {DATA}/")
    inside = {store.url(f"{DATA}/{n}") for n in listed}
    names = sorted(u.rsplit("/", 1)[-1] for u in recorded)
    expected = [shard_name(i, len(names)) for i in range(len(names))]
    missing = [n for n in expected if store.url(f"{DATA}/{n}") not in inside]
    if names != expected or missing:
        raise _refuse(url, f"the shards its published.json names are not all in {DATA}/ ({missing[:5]})")
    return names


@dataclass
class _Mark:
    """A shard's marker: the chunks (index, sha256) it was written from, and its rows."""

    name: str
    chunks: list[tuple[int, str]]
    rows: int


def _marks(url: str, store: Store, names: list[str]) -> list[_Mark]:
    marks: list[_Mark] = []
    for name in names:
        rel = f"{owned.SHARD_MARKS}/{name}.json"
        try:
            raw = orjson.loads(store.read_bytes(rel))
            mark = _Mark(name, [(int(i), str(sha)) for i, sha in raw["chunks"]], int(raw["rows"]))
        except FileNotFoundError:
            raise _refuse(
                url, f"{rel}, the list of the chunks shard {name} was written from, is gone"
            ) from None
        except (ValueError, KeyError, TypeError):
            raise _refuse(
                url, f"{rel}, the list of the chunks shard {name} was written from, is damaged"
            ) from None
        marks.append(mark)
    indexes = [i for m in marks for i, _ in m.chunks]
    if indexes != sorted(set(indexes)):
        raise _refuse(url, "its shards' markers do not list each chunk once, in order")
    return marks


@dataclass
class _Scan:
    """The one streaming pass over the published chunks: fingerprint, counts, order, columns, the plan."""

    url: str
    stopped: Callable[[], bool] | None
    digest: Any = field(default_factory=hashlib.sha256)
    columns: dict[str, str | None] = field(default_factory=dict)
    chunks: list[SourceChunk] = field(default_factory=list)
    rows: int = 0
    tasks: int = 0
    max_k: int = 0
    lines: int = 0
    run: int = 0
    last: RolloutKey = (-1, -1)

    def chunk_rows(self, ledger: Ledger, index: int, sha: str) -> Iterator[dict[str, Any]]:
        """Chunk `index`'s rows, each read with rowjson; its bytes checked against `sha` once read."""
        rel = ledger.chunk_path(index)
        chunk_digest = hashlib.sha256()
        first: int | None = None
        rows = tasks = 0
        try:
            with ledger.open_chunk(index) as fh:
                for lineno, line in enumerate(fh, start=1):
                    self.lines += 1
                    scan_checkpoint(self.lines, self.stopped, self.url)
                    chunk_digest.update(line)
                    self.digest.update(line)
                    if not line.strip():
                        continue
                    try:
                        row, key = rowjson.read_keyed(line, f"{self.url.rstrip('/')}/{rel}", lineno)
                    except rowjson.RowError as exc:
                        raise _refuse(self.url, f"{exc} (not an output row)") from None
                    if key <= self.last:
                        raise _refuse(self.url, f"{rel} line {lineno}: rollout {key} comes after {self.last}")
                    if key[0] != self.last[0]:
                        tasks += 1
                        self.run = 0
                    self.run += 1
                    self.max_k = max(self.max_k, self.run)
                    first = key[0] if first is None else first
                    self.last = key
                    rows += 1
                    add_columns(self.columns, row)
                    yield row
        except FileNotFoundError:
            raise _refuse(self.url, f"chunk {index}'s data ({rel}) is gone") from None
        if chunk_digest.hexdigest() != sha:
            raise _refuse(self.url, f"chunk {index}'s data ({rel}) is not what its shard was written from")
        self.rows += rows
        self.tasks += tasks
        if rows:
            self.chunks.append(SourceChunk(index, first or 0, tasks, rows, sha256=sha))


def _published_rows(scan: _Scan, ledger: Ledger, mark: _Mark, schema: pa.Schema) -> Iterator[dict[str, Any]]:
    """The rows of the chunks `mark` lists, as the shard stores them (its schema), a batch at a time."""
    batch: list[dict[str, Any]] = []
    for index, sha in mark.chunks:
        for row in scan.chunk_rows(ledger, index, sha):
            batch.append(row)
            if len(batch) == BATCH_ROWS:
                yield from _as_stored(scan.url, mark.name, batch, schema)
                batch = []
    yield from _as_stored(scan.url, mark.name, batch, schema)


def _as_stored(url: str, name: str, rows: list[dict[str, Any]], schema: pa.Schema) -> list[dict[str, Any]]:
    try:
        return to_batch(rows, schema).to_pylist()
    except (pa.ArrowException, TypeError, ValueError, OverflowError, KeyError) as exc:
        raise _refuse(url, f"shard {name}'s columns do not hold its chunks' rows ({exc})", name) from None


def _stored_rows(url: str, store: Store, name: str) -> tuple[pa.Schema, int, Iterator[dict[str, Any]]]:
    """A shard's schema, row count and rows (a batch in memory at a time)."""
    fh = store.fs.open(store.path(f"{DATA}/{name}"), "rb")
    try:
        shard = pq.ParquetFile(fh)
        schema = shard.schema_arrow
        if schema.metadata is None or b"rollflow.json_columns" not in schema.metadata:
            raise _refuse(url, f"shard {name} is not one rollflow wrote (no rollflow.json_columns)", name)
    except pa.ArrowException as exc:
        fh.close()
        raise _refuse(url, f"shard {name} cannot be read as Parquet ({exc})", name) from None
    except BaseException:
        fh.close()
        raise

    def rows() -> Iterator[dict[str, Any]]:
        try:
            for batch in shard.iter_batches(batch_size=BATCH_ROWS):
                yield from batch.to_pylist()
        except pa.ArrowException as exc:
            raise _refuse(url, f"shard {name} cannot be read as Parquet ({exc})", name) from None
        finally:
            fh.close()

    return schema, shard.metadata.num_rows, rows()


def scan_shards(url: str, options: dict[str, Any], stopped: Callable[[], bool] | None = None) -> SourcePlan:
    """Plan a reverify of a run's Parquet shards: one chunk per published chunk of the run, after every
    shard is found to hold exactly its chunks' rows."""
    store = Store(url, options)
    ledger = Ledger(store)
    marks = _marks(url, store, _shard_names(url, store))
    scan = _Scan(url, stopped)
    schemas: dict[str, pa.Schema] = {}
    for mark in marks:
        schema, count, stored = _stored_rows(url, store, mark.name)
        schemas[mark.name] = schema
        if count != mark.rows:
            raise _refuse(
                url, f"shard {mark.name} holds {count:,} rows where its marker has {mark.rows:,}", mark.name
            )
        for n, (want, got) in enumerate(_zip(_published_rows(scan, ledger, mark, schema), stored)):
            if want is _END or got is _END:
                more = "more" if want is _END else "fewer"
                raise _refuse(
                    url, f"shard {mark.name} holds {more} rows than the chunks it was written from", mark.name
                )
            if want != got:
                raise _refuse(
                    url,
                    f"shard {mark.name}'s row {n} (from 0) is not the chunk row it was written from",
                    mark.name,
                )
    expected = dataset_schema(scan.columns)
    for name, schema in schemas.items():
        if not schema.equals(expected, check_metadata=True):
            raise _refuse(url, f"shard {name}'s schema is not the one its chunks' rows give", name)
    if scan.rows == 0:
        raise InputError(f"Source {url} holds no rollouts: there is nothing to rescore.")
    return SourcePlan(
        url, "shards", scan.digest.hexdigest(), scan.rows, scan.tasks, scan.max_k, scan.chunks, scan.rows
    )


_END: dict[str, Any] = {"": object()}


def _zip(
    a: Iterator[dict[str, Any]], b: Iterator[dict[str, Any]]
) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """Pairs of both, with _END for the one that ended first (never equal to a row)."""
    for left in a:
        yield left, next(b, _END)
    for right in b:
        yield _END, right


def read_shards_chunk(url: str, chunk: SourceChunk, options: dict[str, Any]) -> list[bytes]:
    """A planned chunk's rows (without newline): its committed object, checked against the hash the plan
    found it with, so a source collected again under a running reverify is refused, never rescored."""
    ledger = Ledger(Store(url, options))
    try:
        with ledger.open_chunk(chunk.index) as fh:
            data = fh.read()
    except FileNotFoundError:
        data = b""
    rows = [line.rstrip(b"\r\n") for line in data.splitlines() if line.strip()]
    if hashlib.sha256(data).hexdigest() != chunk.sha256 or len(rows) != chunk.rows:
        raise SourceChanged(
            f"Source {url} changed after this reverify planned it: chunk {chunk.index} ({chunk.rows:,} "
            f"rollouts of its Parquet dataset) no longer holds the rows planned. Nothing was published. Run "
            f"again with --restart to rescore what the source holds now."
        )
    return rows
