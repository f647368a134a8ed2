"""Streaming input: NeMo Gym JSONL rows read line by line, validated once, planned into chunks."""

from __future__ import annotations

import gzip
import hashlib
import lzma
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rollflow.tasks.backends.formats import request_problem
from rollflow.tasks.collect.routing import AGENT_PROBLEMS, AgentCheck
from rollflow.tasks.storage import rowjson
from rollflow.tasks.storage.store import describe_error, open_input

MAX_BAD_TEXT = 2000
GZIP_MAGIC = b"\x1f\x8b"


class InputError(Exception):
    """The input cannot be used as it is; the message names the file and line and what to do."""


@dataclass(frozen=True)
class ChunkSpec:
    """Task indices first_task .. first_task+num_tasks-1 (bad rows included) starting at byte_offset."""

    index: int
    first_task: int
    num_tasks: int
    good_rows: int
    byte_offset: int
    first_line: int

    @property
    def task_range(self) -> range:
        return range(self.first_task, self.first_task + self.num_tasks)


@dataclass
class BadRow:
    line: int
    task_index: int
    error: str
    text: str


@dataclass
class InputScan:
    url: str
    fingerprint: str
    rows: int
    bad_rows: int
    tasks: int
    chunks: list[ChunkSpec]
    agents: dict[str, int] = field(default_factory=dict)  # agent -> its rows, when rows are routed by agent
    warnings: list[str] = field(default_factory=list)  # what routing warns of (NeMo Gym's warnings)


def row_problem(
    line: bytes, kind: str = "agent", overrides: dict[str, Any] | None = None
) -> tuple[dict[str, Any] | None, str | None]:
    """(row, None) for a row backend `kind` can send and the dataset can store, else (None, what is wrong).

    The same check runs at plan time and when a chunk reads its rows, so a row that passed is sent. It
    checks the parameters as sent, --overrides merged in.
    """
    try:
        row = rowjson.read_row(line)
    except rowjson.RowError as exc:
        return None, exc.problem
    params = row.get("responses_create_params")
    if params is None:
        return None, "the row has no 'responses_create_params' (required by the NeMo Gym row format)"
    if not isinstance(params, dict):
        return None, f"'responses_create_params' must be an object, got {type(params).__name__}"
    if rowjson.too_deep(line, row):
        return (
            None,
            f"the row nests deeper than {rowjson.MAX_ROW_DEPTH} levels, more than a JSONL line can hold",
        )
    problem = request_problem({**params, **overrides} if overrides else params, kind)
    return (None, problem) if problem else (row, None)


def _bad_input(url: str, line: int, problem: str) -> InputError:
    if problem.startswith(AGENT_PROBLEMS):  # the row is well formed; it goes to no agent rollflow can reach
        return InputError(
            f"Input {url}, line {line}: the row cannot be routed: {problem}. Fix the row or the routing, "
            f"or pass --skip-bad-rows to record such rows in <output>/bad_rows.jsonl and go on. No request "
            f"was sent."
        )
    if problem.startswith("--backend-kind"):  # a parameter the backend kind cannot send
        return InputError(
            f"Input {url}, line {line}: {problem}. Change the row (or replace the parameter with "
            f"--overrides), or pass --skip-bad-rows to record such rows in <output>/bad_rows.jsonl and go "
            f"on. No request was sent."
        )
    return InputError(
        f"Input {url}, line {line}: {problem}. Each line must be a JSON object with a "
        f"'responses_create_params' object (NeMo Gym format). Fix or remove the line, or pass "
        f"--skip-bad-rows to record bad rows in <output>/bad_rows.jsonl and go on. No request was sent."
    )


def open_checked(
    url: str, storage_options: dict[str, Any] | None, offset: int = 0, what: str = "Input",
    after: str = "No request was sent.",
):  # fmt: skip
    """`open_input`, with a missing or unreadable file an InputError that names it and says what to do."""
    try:
        return open_input(url, storage_options, offset)
    except FileNotFoundError as exc:
        raise InputError(
            f"{what} {url} does not exist. Check the path (or the bucket and key, and the credentials for "
            f"s3:// URLs). {after}"
        ) from exc
    except Exception as exc:
        raise InputError(f"{what} {url} cannot be opened: {describe_error(url, exc)}. {after}") from exc


def read_lines(
    fh: Any, url: str, what: str = "Input", after: str = "No request was sent."
) -> Iterator[bytes]:
    """The file's lines, with a compressed file cut short or damaged (EOFError, a bad gzip, zlib or xz
    stream) an InputError naming the file and the line it broke at, not a traceback."""
    lineno = 0
    try:
        for lineno, line in enumerate(fh, start=1):  # noqa: B007 - lineno is read if the stream breaks
            yield line
    except (EOFError, zlib.error, lzma.LZMAError, gzip.BadGzipFile) as exc:
        raise InputError(
            f"{what} {url}, line {lineno + 1}: the compressed file is damaged or cut short "
            f"({type(exc).__name__}: {exc}). Write it again whole. {after}"
        ) from exc


@dataclass
class _ChunkCutter:
    """Cuts the scanned lines into chunks of `size` tasks, noting each chunk's first task, offset and line."""

    size: int
    chunks: list[ChunkSpec] = field(default_factory=list)
    start: tuple[int, int, int] | None = None  # (first_task, byte_offset, first_line)
    good: int = 0

    def open(self, task: int, offset: int, lineno: int) -> None:
        if self.start is None:
            self.start, self.good = (task, offset, lineno), 0

    def close(self, tasks: int, *, full_only: bool) -> None:
        if self.start is None or (full_only and tasks - self.start[0] < self.size):
            return
        first, offset, line = self.start
        self.chunks.append(ChunkSpec(len(self.chunks), first, tasks - first, self.good, offset, line))
        self.start = None


class ScanStopped(Exception):
    """The run was stopped (Ctrl-C, SIGTERM) while its input was being scanned."""


STOP_EVERY = 4096  # rows between two looks at whether the scan was stopped


def scan_checkpoint(lineno: int, stopped: Callable[[], bool] | None, url: str) -> None:
    """Every STOP_EVERY lines of a scan on a thread: hand the GIL to the process's other threads, then
    raise ScanStopped if the run stopped. Without the hand-over, CPython 3.11 let a scan's loop hold the
    GIL against the run's event loop for 0.3 to 0.8 s at a time (its cancellation and lease waited)."""
    if lineno % STOP_EVERY:
        return
    time.sleep(0)
    if stopped is not None and stopped():
        raise ScanStopped(f"the scan of {url} was stopped at line {lineno}")


def stop_before_writing(stopped: Callable[[], bool] | None, url: str) -> None:
    """One last look before a plan writes run.json: a run stopped after the scan's last look (up to
    STOP_EVERY rows before its end) must not write it after letting go of its output."""
    if stopped is not None and stopped():
        raise ScanStopped(f"the plan of {url} was stopped after its scan, before writing run.json")


def scan_input(
    url: str,
    *,
    chunk_size: int,
    limit: int | None,
    skip_bad_rows: bool,
    storage_options: dict[str, Any] | None = None,
    on_bad_row: Callable[[BadRow], None] | None = None,
    kind: str = "agent",
    overrides: dict[str, Any] | None = None,
    stopped: Callable[[], bool] | None = None,
    agents: AgentCheck | None = None,
) -> InputScan:
    """One streaming pass: validate every row, fingerprint the bytes, and note each chunk's offset.

    `stopped` is asked every STOP_EVERY rows: a scan runs on a thread, which a stopped run cannot cancel."""
    digest = hashlib.sha256()
    cutter = _ChunkCutter(chunk_size)
    tasks = good = bad = offset = 0
    with open_checked(url, storage_options) as fh:
        for lineno, line in enumerate(read_lines(fh, url), start=1):
            line_offset, offset = offset, offset + len(line)
            if limit is not None and tasks >= limit:
                break
            scan_checkpoint(lineno, stopped, url)
            digest.update(line)
            if lineno == 1 and line.startswith(GZIP_MAGIC):
                raise InputError(
                    f"Input {url} is gzip-compressed but its name does not say so. Name it *.jsonl.gz "
                    f"(compressed inputs are read by their extension) or decompress it. No request was sent."
                )
            if not line.strip():
                continue
            cutter.open(tasks, line_offset, lineno)
            row, problem = row_problem(line.rstrip(b"\r\n"), kind, overrides)
            if problem is None and agents is not None:
                problem = agents.problem(row)  # type: ignore[arg-type]
            if problem is None:
                good += 1
                cutter.good += 1
            elif not skip_bad_rows:
                raise _bad_input(url, lineno, problem)
            else:
                bad += 1
                if on_bad_row is not None:
                    text = line[:MAX_BAD_TEXT].decode("utf-8", "replace").rstrip("\r\n")
                    on_bad_row(BadRow(lineno, tasks, problem, text))
            tasks += 1
            cutter.close(tasks, full_only=True)
    cutter.close(tasks, full_only=False)
    if good == 0:
        what = "has no rows" if bad == 0 else f"has no valid rows ({bad} bad)"
        raise InputError(
            f"Input {url} {what}. Expected one NeMo Gym row (a JSON object with 'responses_create_params') "
            f"per line. No request was sent."
        )
    used = dict(agents.used) if agents is not None else {}
    said = agents.warnings() if agents is not None else []
    return InputScan(url, digest.hexdigest(), good, bad, tasks, cutter.chunks, used, said)


def iter_chunk_rows(
    url: str,
    chunk: ChunkSpec,
    storage_options: dict[str, Any] | None = None,
    kind: str = "agent",
    overrides: dict[str, Any] | None = None,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(task_index, row) for the chunk's valid rows, in order, reading from the chunk's byte offset."""
    task = chunk.first_task
    end = chunk.first_task + chunk.num_tasks
    with open_checked(url, storage_options, chunk.byte_offset) as fh:
        for line in read_lines(fh, url):
            if task >= end:
                return
            if not line.strip():
                continue
            row, problem = row_problem(line.rstrip(b"\r\n"), kind, overrides)
            if problem is None:
                yield task, row
            task += 1
