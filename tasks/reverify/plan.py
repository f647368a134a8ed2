"""Planning a reverify: scan the source once and bind the output to it (resume, refuse or restart)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from rollflow.settings import redact
from rollflow.settings.reverify import ReverifySpec
from rollflow.tasks.collect.plan import config_hash, rollflow_version
from rollflow.tasks.collect.rows import InputError, stop_before_writing
from rollflow.tasks.reverify.source import SourceChunk, SourcePlan, dataset_file, scan_dataset, scan_failed
from rollflow.tasks.storage.ledger import ChunkManifest, Ledger, RunIdentity
from rollflow.tasks.storage.owned import location
from rollflow.tasks.storage.store import Store


@dataclass
class ReverifyPlan:
    source: SourcePlan
    identity: RunIdentity
    committed: dict[int, ChunkManifest]

    @property
    def pending(self) -> list[SourceChunk]:
        return [
            c for c in self.source.chunks if c.index not in self.committed or self.committed[c.index].failed
        ]


def reverify_config(spec: ReverifySpec, mode: str) -> dict[str, Any]:
    """What changes the rescored dataset: the verifier and how the source is read; not parallelism."""
    verifier = spec.verify.verifier_for("responses")  # reverify scores every row, as a responses run
    return {
        "reverify": mode,
        "verifier": verifier,
        "verifier_url": spec.verify.url if verifier == "http" else None,
    }


def _where(url: str, options: dict[str, Any]) -> tuple[str, str]:
    protocol, path, fs = location(url, options)
    if isinstance(fs, LocalFileSystem):
        path = os.path.realpath(path)  # a symlink to the source folder is the source folder
    return protocol, path.rstrip("/")


def check_apart(source: str, output: str, options: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """The source is never written: refuse an output that is the source or holds it, or lies inside it."""
    (sp, src), (op, out) = _where(source, options[0]), _where(output, options[1])
    if sp == op and (src == out or src.startswith(out + "/") or out.startswith(src + "/")):
        raise InputError(
            f"Source {source} and output {output} overlap; reverify never writes into its source. Choose an "
            f"--output outside the source folder."
        )


def plan_reverify(
    spec: ReverifySpec,
    store: Store,
    ledger: Ledger,
    source_options: dict[str, Any],
    output_options: dict[str, Any],
    stopped: Callable[[], bool] | None = None,
) -> ReverifyPlan:
    """Fail fast (bad source, overlap, a different reverify in the output) before any check runs."""
    check_apart(spec.source, spec.output, (source_options, output_options))
    store.check_writable()
    if spec.failed_only:
        source = scan_failed(spec.source, source_options, stopped)
    else:
        url = dataset_file(spec.source, source_options)
        if url is None:  # a run's Parquet shards: read through the committed chunks they were written from
            from rollflow.tasks.reverify.shards import scan_shards  # pyarrow: only a Parquet source pays it

            source = scan_shards(spec.source, source_options, stopped)
        else:
            source = scan_dataset(url, spec.chunk_size, source_options, stopped)
    config = reverify_config(spec, source.mode)
    chunk_size = spec.chunk_size if source.mode == "dataset" else 0
    identity = RunIdentity(
        input_url=redact.redact(source.url),  # run.json holds no user:password of the source's URL
        input_fingerprint=source.fingerprint,
        rows=source.rows,
        tasks=source.tasks,
        num_repeats=source.max_k,
        chunk_size=chunk_size,
        config=config,
        config_hash=config_hash(config, source.max_k, chunk_size),
        chunks=[dataclasses.asdict(c) for c in source.chunks],
        created_at=datetime.now(UTC).isoformat(),
        rollflow_version=rollflow_version(),
        dataset_url=spec.dataset_url(),
    )
    stop_before_writing(stopped, spec.source)
    identity = ledger.open_run(identity, restart=spec.restart, options=output_options, keep=spec.source)
    return ReverifyPlan(source, identity, ledger.committed())
