"""Planning a run: check the output, scan the input once, and bind both to the run identity."""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import orjson

from rollflow.settings import RunSpec
from rollflow.tasks.backends.formats import overrides_problem
from rollflow.tasks.collect.paths import card_url, check_paths
from rollflow.tasks.collect.routing import AgentCheck, agent_map_of
from rollflow.tasks.collect.rows import BadRow, InputError, InputScan, scan_input, stop_before_writing
from rollflow.tasks.collect.stoppable import run_stoppable
from rollflow.tasks.storage import chunk_spans
from rollflow.tasks.storage.ledger import ChunkManifest, Ledger, RunIdentity
from rollflow.tasks.storage.store import Store

AUTO_CHUNK_ROWS = 1000  # --chunk-size auto on every runner, up to AUTO_CHUNK_ROLLOUTS a chunk
AUTO_CHUNK_ROLLOUTS = 5000  # with many repeats, fewer rows: the run keeps enough chunks to spread and resume
# Below this many rollouts a Dask or Ray chunk's dispatch (~15-20 ms of CPU) is a visible part of its cost.
SMALL_REMOTE_CHUNK_ROLLOUTS = 500


@dataclass
class RunPlan:
    scan: InputScan
    identity: RunIdentity
    committed: dict[int, ChunkManifest]

    @property
    def pending(self) -> list[Any]:
        """Chunks that still need work: never committed, or committed with failed rollouts."""
        return [
            c for c in self.scan.chunks if c.index not in self.committed or self.committed[c.index].failed
        ]

    def resumed(self) -> tuple[int, int] | None:
        """(rollouts already committed, rollouts of the whole run) when the output holds committed chunks of
        this run (a resumed run); None for a fresh one."""
        chunks = {c.index for c in self.scan.chunks}
        done = [m for i, m in self.committed.items() if i in chunks]
        if not done:
            return None
        planned = sum(c.good_rows for c in self.scan.chunks) * self.identity.num_repeats
        return sum(m.rows for m in done), planned


def rollout_config(spec: RunSpec) -> dict[str, Any]:
    """The settings that change what a rollout is; parallelism, URLs and timeouts do not."""
    kind = spec.backend.kind.value
    return {
        "backend_kind": spec.backend.kind.value,
        "model": spec.backend.model,
        "overrides": spec.collection.overrides,
        "agent_name": spec.collection.agent_name,
        # only when set, so outputs written before they existed keep their identity
        **({"agent_map": spec.collection.agent_map} if spec.collection.agent_map else {}),
        **({"repeat_seed": True} if spec.collection.repeat_seed else {}),
        # an agent's default (none) stays None, as before agents could be given a verifier
        "verifier": spec.verify.verifier if kind == "agent" else spec.verify.verifier_for(kind),
        "limit": spec.collection.limit,
        "skip_bad_rows": spec.collection.skip_bad_rows,
        # only when set, so outputs written before --seed existed keep their identity
        **({"seed": spec.collection.seed} if spec.collection.seed is not None else {}),
        # settling decides which rollouts exist, at the correct threshold: both define the run when set
        **(
            {"settle_after": spec.collection.settle_after, "correct_threshold": spec.verify.correct_threshold}
            if spec.collection.settle_after is not None
            else {}
        ),
    }


def agent_check(spec: RunSpec) -> AgentCheck | None:
    """An agent run's rows are checked against the agents the backend knows (one agent for one server
    given by URL), before any request."""
    if spec.backend.kind.value != "agent":
        return None
    col, backend = spec.collection, spec.backend
    return AgentCheck(
        agent_map_of(col.agent_name, col.agent_map),
        frozenset(backend.agents) if backend.agents else None,
        backend.sources,
        col.num_repeats_by_agent,
        col.num_repeats if col.num_repeats_by_agent else None,
    )


def rollflow_version() -> str:
    """The installed rollflow's version, recorded in run.json and the reports."""
    try:
        return version("rollflow")
    except PackageNotFoundError:
        return "0+unknown"


def config_hash(config: dict[str, Any], num_repeats: int, chunk_size: int) -> str:
    canonical = orjson.dumps(
        {"config": config, "num_repeats": num_repeats, "chunk_size": chunk_size}, option=orjson.OPT_SORT_KEYS
    )
    return hashlib.sha256(canonical).hexdigest()


def chunk_rows(spec: RunSpec, stored: RunIdentity | None) -> int:
    """`--chunk-size auto` as rows: a resumed run keeps its chunks (whichever runner started it, and however
    auto was sized when it did); a new one gets AUTO_CHUNK_ROWS, or fewer when they make more than
    AUTO_CHUNK_ROLLOUTS."""
    size = spec.collection.chunk_size
    if size != "auto":
        return size
    if stored is not None and not spec.restart:
        return stored.chunk_size
    return min(AUTO_CHUNK_ROWS, -(-AUTO_CHUNK_ROLLOUTS // spec.collection.num_repeats))


def with_chunk_rows(spec: RunSpec, rows: int) -> RunSpec:
    """The spec with its chunk size as the plan resolved it, for what runs after the plan."""
    if spec.collection.chunk_size == rows:
        return spec
    return spec.model_copy(update={"collection": spec.collection.model_copy(update={"chunk_size": rows})})


def _check_overrides(spec: RunSpec) -> None:
    """A parameter of --overrides the backend kind cannot send is refused by its flag, before the scan."""
    problem = overrides_problem(spec.collection.overrides, spec.backend.kind.value)
    if problem:
        raise InputError(
            f"--overrides (or +responses_create_params.*): {problem}. Change or remove that parameter. "
            f"No request was sent."
        )


def plan_run(
    spec: RunSpec,
    store: Store,
    ledger: Ledger,
    input_options: dict[str, Any],
    parallelism: int | None,
    dataset_options: dict[str, Any] | None = None,
    stopped: Callable[[], bool] | None = None,
) -> RunPlan:
    """Fail fast (bad paths, output, input, changed run) before a single request is sent."""
    store.check_writable()
    dataset_options = dataset_options or {}
    card = card_url(spec.published_url(), spec.output)
    check_paths(spec.input, spec.output, spec.dataset_url(), (input_options, dataset_options), store, card)
    _check_overrides(spec)
    stored = ledger.stored_identity()
    size = chunk_rows(spec, stored)
    with tempfile.SpooledTemporaryFile(max_size=4 * 1024 * 1024) as bad:

        def record(row: BadRow) -> None:
            bad.write(
                orjson.dumps(
                    {"line": row.line, "task_index": row.task_index, "error": row.error, "text": row.text}
                )
                + b"\n"
            )

        scan = scan_input(
            spec.input,
            chunk_size=size,
            limit=spec.collection.limit,
            skip_bad_rows=spec.collection.skip_bad_rows,
            storage_options=input_options,
            on_bad_row=record,
            kind=spec.backend.kind.value,
            overrides=spec.collection.overrides,
            stopped=stopped,
            agents=agent_check(spec),
        )
        config = rollout_config(spec)
        identity = RunIdentity(
            input_url=spec.input,
            input_fingerprint=scan.fingerprint,
            rows=scan.rows,
            tasks=scan.tasks,
            num_repeats=spec.collection.num_repeats,
            chunk_size=size,
            config=config,
            config_hash=config_hash(config, spec.collection.num_repeats, size),
            chunks=[_chunk_dict(c) for c in scan.chunks],
            parallelism=parallelism,
            created_at=datetime.now(UTC).isoformat(),
            rollflow_version=rollflow_version(),
            dataset_url=spec.dataset_url(),
        )
        stop_before_writing(stopped, spec.input)
        identity = ledger.open_run(identity, restart=spec.restart, options=dataset_options, keep=spec.input)
        if scan.bad_rows:
            bad.seek(0)
            ledger.write_bad_rows(bad)
        lost = chunk_spans.lost_dataset(store, identity.run_id)
        if lost is not None:
            scan.warnings.append(
                f"the dataset {lost} this output published is gone or was changed since (it is not the size "
                f"published), and it was the only copy of its chunks' rows (their chunk objects go once a "
                f"dataset holds them; --keep-chunks keeps them): those chunks are collected again"
            )
    return RunPlan(scan=scan, identity=identity, committed=ledger.committed())


def _chunk_dict(chunk: Any) -> dict[str, Any]:
    return {
        "index": chunk.index,
        "first_task": chunk.first_task,
        "num_tasks": chunk.num_tasks,
        "good_rows": chunk.good_rows,
        "byte_offset": chunk.byte_offset,
        "first_line": chunk.first_line,
    }


async def plan_stoppable(
    spec: RunSpec,
    store: Store,
    ledger: Ledger,
    input_options: dict[str, Any],
    parallelism: int | None,
    dataset_options: dict[str, Any] | None = None,
) -> RunPlan:
    """plan_run on a thread that a cancelled run stops (tasks/collect/stoppable.py): the plan never writes
    run.json after the run has let go of the output, and the process exits promptly."""
    return await run_stoppable(
        lambda stopped: plan_run(
            spec, store, ledger, input_options, parallelism, dataset_options, stopped=stopped
        )
    )
