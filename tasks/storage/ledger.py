"""The chunk ledger: run identity, chunk objects and their manifests (the commit markers)."""

from __future__ import annotations

import contextlib
import hashlib
import secrets
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from typing import IO, Any

from pydantic import BaseModel, Field, ValidationError

from rollflow.tasks.storage import chunk_spans, owned
from rollflow.tasks.storage.store import Store

RUN = "run.json"
CHUNKS, FAILURES = "chunks", "failures"
BAD_ROWS = "bad_rows.jsonl"
RUN_OUTPUTS = (BAD_ROWS, chunk_spans.SPANS)  # beside its state; what it publishes is in owned.py
RUN_DIRS = (CHUNKS, FAILURES, "audit", "parts")


class RunIdentity(BaseModel):
    """What a run is: resuming is allowed only into the same identity."""

    input_url: str
    input_fingerprint: str
    rows: int
    tasks: int
    num_repeats: int
    chunk_size: int
    config: dict[str, Any]
    config_hash: str
    chunks: list[dict[str, Any]]
    parallelism: int | None = None
    created_at: str
    rollflow_version: str
    # New for every fresh start (and every --restart), kept on resume: parts and manifests carry it,
    # so nothing written under a discarded run is ever adopted or published. "" for older outputs.
    run_id: str = ""
    # Where the run publishes its dataset (also outside the output), so --restart can remove it.
    dataset_url: str | None = None


class ChunkManifest(BaseModel):
    """Written after the chunk's data object: its existence is the commit."""

    chunk: int
    first_task: int
    num_tasks: int
    rows_expected: int
    rows: int
    failed: int
    sha256: str
    bytes: int
    started_at: str
    committed_at: str
    wall_s: float
    attempt: int
    stats: dict[str, Any] = Field(default_factory=dict)
    run_id: str = ""
    # --settle-after: task index -> the rollouts it got before it settled (its later ones were never
    # requested, so they are not expected); empty without settling.
    settled: dict[int, int] = Field(default_factory=dict)


class IdentityMismatch(Exception):
    """The output holds a different run; the message lists what changed."""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def identity_changes(old: RunIdentity, new: RunIdentity) -> list[str]:
    changes: list[str] = []
    if old.input_fingerprint != new.input_fingerprint:
        changes.append(
            f"input fingerprint changed (sha256 {old.input_fingerprint[:12]}... -> "
            f"{new.input_fingerprint[:12]}...: the input's content or --limit changed)"
        )
    if old.input_url != new.input_url and old.input_fingerprint != new.input_fingerprint:
        changes.append(f"input {old.input_url} -> {new.input_url}")
    for field in ("rows", "num_repeats", "chunk_size"):
        a, b = getattr(old, field), getattr(new, field)
        if a != b:
            changes.append(f"{field} {a} -> {b}")
    for key in sorted(set(old.config) | set(new.config)):
        a, b = old.config.get(key), new.config.get(key)
        if a != b:
            changes.append(f"config.{key} {_short(a)} -> {_short(b)}")
    if not changes and old.config_hash != new.config_hash:
        changes.append(f"config hash {old.config_hash[:12]}... -> {new.config_hash[:12]}...")
    if not changes and old.chunks != new.chunks:
        changes.append("the chunk plan differs")
    return changes


class Ledger:
    """Reads and writes the run's objects under one Store; every object is written whole."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._run_id: str | None = None
        # This command's own id: its probe parts carry it, so its report counts only its own probes.
        self.session = secrets.token_hex(4)
        # Called before every commit; the run's lease sets it, so a run that lost the output commits nothing.
        self.fence: Callable[[], None] | None = None

    @property
    def run_id(self) -> str:
        """The bound run's id: set by open_run, else read once from run.json (a worker process)."""
        if self._run_id is None:
            stored = self.stored_identity()
            self._run_id = stored.run_id if stored is not None else ""
        return self._run_id

    @staticmethod
    def chunk_path(i: int) -> str:
        return f"{CHUNKS}/{i:05d}.jsonl"

    @staticmethod
    def manifest_path(i: int) -> str:
        return f"{CHUNKS}/{i:05d}.json"

    @staticmethod
    def failures_path(i: int) -> str:
        return f"{FAILURES}/{i:05d}.jsonl"

    def stored_identity(self) -> RunIdentity | None:
        if not self.store.exists(RUN):
            return None
        return RunIdentity.model_validate_json(self.store.read_bytes(RUN))

    def open_run(
        self,
        identity: RunIdentity,
        restart: bool,
        options: dict[str, Any] | None = None,
        keep: str | None = None,
    ) -> RunIdentity:
        """Bind the output to this run: new, resumed, refused (IdentityMismatch) or restarted. A run it
        replaces leaves nothing: its run state here, and all it published (`options` reach the dataset's
        store; `keep`, the input, is never removed)."""
        stored = self.stored_identity()
        if stored is not None:
            changes = identity_changes(stored, identity)
            if not changes and not restart:
                moved = identity.dataset_url is not None and identity.dataset_url != stored.dataset_url
                if moved or (identity.parallelism is not None and identity.parallelism != stored.parallelism):
                    stored.parallelism = identity.parallelism or stored.parallelism
                    stored.dataset_url = identity.dataset_url or stored.dataset_url
                    self._write_identity(stored)
                self._run_id = stored.run_id
                owned.start_record(self.store)
                return stored
            if changes and not restart:
                committed = len(self.committed())
                raise IdentityMismatch(
                    f"The output {self.store.root_url} holds a different run ({committed} committed "
                    f"chunks), so it cannot be resumed: " + "; ".join(changes) + ". The committed chunks "
                    "were kept. Use a different --output for the new run, or pass --restart to discard "
                    "them and start over."
                )
        identity = identity.model_copy(update={"run_id": secrets.token_hex(8)})
        # The new identity first: from then on every object of the old run is foreign (its run_id
        # differs), so a crash in the middle of the clean-up below cannot bring old rollouts back.
        self._write_identity(identity)
        self._run_id = identity.run_id
        if stored is not None or restart:
            self.discard_run(keep_identity=True)
        if stored is not None:  # what the replaced run published; a folder with no run keeps its files
            owned.discard(self.store, options or {}, stored.dataset_url, keep=keep)
        owned.start_record(self.store)
        return identity

    def discard_run(self, keep_identity: bool = False) -> None:
        for rel in RUN_DIRS:
            self.store.delete_tree(rel)
        for rel in RUN_OUTPUTS:
            self.store.delete(rel)
        if not keep_identity:
            self.store.delete(RUN)

    def _write_identity(self, identity: RunIdentity) -> None:
        self.store.write_bytes(RUN, identity.model_dump_json(indent=2).encode())

    def update_parallelism(self, parallelism: int) -> None:
        stored = self.stored_identity()
        if stored is not None and stored.parallelism != parallelism:
            stored.parallelism = parallelism
            self._write_identity(stored)

    def manifest(self, i: int) -> ChunkManifest | None:
        """Chunk i's manifest if it is a commit of this run whose data is still there (another run's
        manifest, or one whose data is gone, is no commit)."""
        rel = self.manifest_path(i)
        try:
            manifest = ChunkManifest.model_validate_json(self.store.read_bytes(rel))
        except (FileNotFoundError, IsADirectoryError, ValidationError, ValueError):
            return None
        if manifest.run_id != self.run_id or not self._holds_data(i):
            return None
        return manifest

    def _holds_data(self, i: int) -> bool:
        """Chunk i's data is readable: its object, or its span of the published dataset."""
        if self.store.exists(self.chunk_path(i)):
            return True
        try:
            chunk_spans.located(self.store, self.run_id, i)
        except FileNotFoundError:
            return False
        return True

    def chunk_stamp(self, i: int) -> str:
        """What changes when chunk i's data is rewritten (its object's stamp, or its span once dropped)."""
        try:
            return self.store.stamp(self.chunk_path(i))
        except FileNotFoundError:
            return chunk_spans.located(self.store, self.run_id, i)[1].stamp

    def uncommit(self, i: int) -> None:
        """Withdraw chunk i's commit (its data no longer matches): the chunk is collected again."""
        self.store.delete(self.manifest_path(i))

    def committed(self) -> dict[int, ChunkManifest]:
        """Every committed chunk's manifest, from one listing: a manifest whose data is gone (its object,
        or its span once dropped) vouches for nothing, so that chunk is collected again."""
        listed = self.store.list(CHUNKS)
        names = [n for n in listed if n.endswith(".json") and n[:-5].isdigit()]
        held = {int(n[:-6]) for n in listed if n.endswith(".jsonl") and n[:-6].isdigit()}
        if len(held) < len(names):
            held |= chunk_spans.readable(self.store, self.run_id)
        found: dict[int, ChunkManifest] = {}
        for rel, data in self.store.read_many([f"{CHUNKS}/{n}" for n in names]).items():
            try:
                manifest = ChunkManifest.model_validate_json(data)
            except (ValidationError, ValueError):
                continue  # a torn or foreign object is not a commit
            mine = rel == self.manifest_path(manifest.chunk) and manifest.run_id == self.run_id
            if mine and manifest.chunk in held:
                found[manifest.chunk] = manifest
        return dict(sorted(found.items()))

    def commit(self, i: int, data: bytes, failures: bytes | None, manifest: ChunkManifest) -> None:
        """Data object, then failures, then the manifest: a crash before the last write commits nothing."""
        manifest.sha256 = hashlib.sha256(data).hexdigest()
        manifest.bytes = len(data)
        manifest.run_id = self.run_id
        if self.fence is not None:
            self.fence()
        self.store.write_bytes(self.chunk_path(i), data)
        if failures:
            self.store.write_bytes(self.failures_path(i), failures)
        else:
            self.store.delete(self.failures_path(i))
        manifest.committed_at = datetime.now(UTC).isoformat()
        if self.fence is not None:
            self.fence()
        self.store.write_bytes(self.manifest_path(i), manifest.model_dump_json().encode())

    @contextlib.contextmanager
    def open_chunk(self, i: int) -> Iterator[IO[bytes]]:
        """Chunk i's data: its object, or once dropped after publishing, its span of the dataset."""
        try:
            fh = self.store.open_read(self.chunk_path(i))
        except FileNotFoundError:
            fh = chunk_spans.open_span(self.store, self.run_id, i)
        try:
            yield fh
        finally:
            fh.close()

    def write_bad_rows(self, src: IO[bytes] | Iterable[bytes]) -> None:
        """bad_rows.jsonl, whole: from a file (copied in blocks) or from JSONL lines."""
        with self.store.open_write(BAD_ROWS) as out:
            read = getattr(src, "read", None)
            if read is not None:
                while block := read(1 << 20):
                    out.write(block)
                return
            for line in src:
                out.write(line if line.endswith(b"\n") else line + b"\n")
