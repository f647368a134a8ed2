"""The dataset as sharded Parquet under <dataset dir>/: written from the committed chunks, a batch at a time.

Columns follow the rows' top-level keys. A key whose values are all strings, all integers, all floats or
all booleans (nulls aside) gets that Arrow type; `reward` with integers and floats is float64. Anything
else (objects, lists, mixed types: `response`, `responses_create_params`, `_rf`, ...) is stored as its
JSON text, so nothing is lost; the file's metadata lists those columns under `rollflow.json_columns`.

Shards group whole chunks (about `shard_rows` rows or `shard_bytes` of JSON each) and are named
train-NNNNN-of-MMMMM.parquet; each is written whole, then marked with the chunks' hashes, so a resumed
publish skips the shards already written from the same chunks and nothing is written twice.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from rollflow.tasks.publish.concat import chunk_changed, publish_failed
from rollflow.tasks.storage import owned, rowjson
from rollflow.tasks.storage.ledger import ChunkManifest, Ledger
from rollflow.tasks.storage.owned import SHARD, SHARD_MARKS
from rollflow.tasks.storage.store import Store

SHARD_ROWS = 250_000
SHARD_BYTES = 256 * 1024 * 1024
BATCH_ROWS = 5_000
MARKS = SHARD_MARKS  # shard markers, in the output (ledger) store
COLUMNS_CACHE = "audit/{:05d}.columns.json"
_ARROW = {
    "str": pa.string(),
    "int": pa.int64(),
    "float": pa.float64(),
    "bool": pa.bool_(),
    "json": pa.string(),
}


def _kind(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int" if -(2**63) <= value < 2**63 else "json"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    return "json"


def _merge(a: str | None, b: str | None, key: str) -> str | None:
    if a is None or a == b:
        return b if a is None else a
    if b is None:
        return a
    if key == "reward" and {a, b} == {"int", "float"}:
        return "float"
    return "json"


def add_columns(columns: dict[str, str | None], row: dict[str, Any]) -> None:
    """A row's top-level keys and their kinds merged into `columns`: how the dataset's schema is found."""
    for key, value in row.items():
        columns[key] = _merge(columns.get(key), _kind(value), key)


def chunk_columns(ledger: Ledger, manifest: ChunkManifest) -> dict[str, str | None]:
    """Each top-level key of a committed chunk's rows and its kind, kept beside the audit by hash."""
    cache = COLUMNS_CACHE.format(manifest.chunk)
    store = ledger.store
    if store.exists(cache):
        cached = orjson.loads(store.read_bytes(cache))
        if cached["sha256"] == manifest.sha256:
            return cached["columns"]
    columns: dict[str, str | None] = {}
    with ledger.open_chunk(manifest.chunk) as fh:
        for line in fh:
            if line.strip():
                add_columns(columns, _row(ledger, manifest, line))
    store.write_bytes(cache, orjson.dumps({"sha256": manifest.sha256, "columns": columns}))
    return columns


def _row(ledger: Ledger, manifest: ChunkManifest, line: bytes) -> dict[str, Any]:
    """A row of a committed chunk; a line that is no row means its bytes changed since the audit."""
    try:
        return rowjson.read_row(line)
    except rowjson.RowError:
        raise chunk_changed(ledger, manifest.chunk) from None


def dataset_schema(columns: dict[str, str | None]) -> pa.Schema:
    json_columns = [k for k, kind in columns.items() if kind == "json"]
    fields = [pa.field(k, _ARROW[kind or "str"]) for k, kind in columns.items()]
    return pa.schema(fields, metadata={"rollflow.json_columns": orjson.dumps(json_columns)})


@dataclass
class Shard:
    index: int
    chunks: list[ChunkManifest] = field(default_factory=list)
    rows: int = 0
    bytes: int = 0

    def mark(self, of: int) -> bytes:
        return orjson.dumps(
            {"of": of, "chunks": [[m.chunk, m.sha256] for m in self.chunks], "rows": self.rows}
        )


def plan_shards(manifests: list[ChunkManifest], shard_rows: int, shard_bytes: int) -> list[Shard]:
    shards: list[Shard] = []
    for manifest in manifests:
        if not shards or shards[-1].rows >= shard_rows or shards[-1].bytes >= shard_bytes:
            shards.append(Shard(len(shards)))
        shard = shards[-1]
        shard.chunks.append(manifest)
        shard.rows += manifest.rows
        shard.bytes += manifest.bytes
    return shards


def shard_name(index: int, of: int) -> str:
    return f"train-{index:05d}-of-{of:05d}.parquet"


def to_batch(rows: list[dict[str, Any]], schema: pa.Schema) -> pa.RecordBatch:
    """Rows as one record batch of `schema`, as a shard stores them: a missing key is null, a JSON column
    holds its value's JSON text."""
    json_cols = set(orjson.loads(schema.metadata[b"rollflow.json_columns"]))
    cols: dict[str, list[Any]] = {f.name: [] for f in schema}
    for row in rows:
        for name, values in cols.items():
            value = row.get(name)
            if name in json_cols and value is not None:
                value = rowjson.dumps(value).decode()
            values.append(value)
    return pa.RecordBatch.from_pydict(cols, schema=schema)


def _batches(ledger: Ledger, shard: Shard, schema: pa.Schema) -> Iterator[pa.RecordBatch]:
    """The shard's rows as record batches of BATCH_ROWS, each chunk's bytes checked against its manifest."""
    rows: list[dict[str, Any]] = []
    for manifest in shard.chunks:
        digest = hashlib.sha256()
        with ledger.open_chunk(manifest.chunk) as fh:
            for line in fh:
                digest.update(line)
                if not line.strip():
                    continue
                rows.append(_row(ledger, manifest, line))
                if len(rows) == BATCH_ROWS:
                    yield to_batch(rows, schema)
                    rows = []
        if digest.hexdigest() != manifest.sha256:
            raise chunk_changed(ledger, manifest.chunk)
    if rows:
        yield to_batch(rows, schema)


def write_parquet(
    ledger: Ledger,
    manifests: list[ChunkManifest],
    data_url: str,
    options: dict[str, Any],
    shard_rows: int = SHARD_ROWS,
    shard_bytes: int = SHARD_BYTES,
) -> list[str]:
    """Write (or keep, when already written from the same chunks) every shard; returns their names. A
    full disk (any write error) is one PublishFailed, as for JSONL; the partial shard never appears."""
    try:
        return _write_parquet(ledger, manifests, data_url, options, shard_rows, shard_bytes)
    except OSError as exc:
        raise publish_failed(data_url, ledger, sum(m.bytes for m in manifests), exc) from exc


def _write_parquet(
    ledger: Ledger,
    manifests: list[ChunkManifest],
    data_url: str,
    options: dict[str, Any],
    shard_rows: int,
    shard_bytes: int,
) -> list[str]:
    columns: dict[str, str | None] = {}
    for manifest in manifests:
        for key, kind in chunk_columns(ledger, manifest).items():
            columns[key] = _merge(columns.get(key), kind, key)
    schema = dataset_schema(columns)
    schema_tag = hashlib.sha256(schema.to_string().encode()).hexdigest()[:16]
    shards = plan_shards(manifests, shard_rows, shard_bytes)
    target = Store(data_url, options)
    names = [shard_name(s.index, len(shards)) for s in shards]
    owned.record(ledger.store, owned.SHARDS, [target.url(n) for n in names], options)  # before they exist
    target.remove_stale_in("", SHARD)  # dead partial copies a killed publish left
    for shard, name in zip(shards, names, strict=True):
        mark_rel = f"{MARKS}/{name}.json"
        mark = shard.mark(len(shards))[:-1] + b',"schema":"' + schema_tag.encode() + b'"}'
        if (
            ledger.store.exists(mark_rel)
            and target.exists(name)
            and ledger.store.read_bytes(mark_rel) == mark
        ):
            continue
        with target.open_write(name) as out, pq.ParquetWriter(out, schema, compression="zstd") as writer:
            for batch in _batches(ledger, shard, schema):
                writer.write_batch(batch)
        ledger.store.write_bytes(mark_rel, mark)
    for stale in set(target.list("")) - set(names):
        if SHARD.match(stale):  # an older run's shard
            target.delete(stale)
    return names
