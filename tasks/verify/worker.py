"""One verifier process: reads (row, text) checks from stdin, writes rewards to stdout, one at a time.

Run as `python -m rollflow.tasks.verify.worker SPEC PARENT_PID` by the verify pool. It is a plain
subprocess, not a multiprocessing child, so Dask's daemonic workers may start it too. Checks run in the
process's main thread, where math-verify's SIGALRM timeouts work. Messages are a 4-byte length and a
pickle (exact values of any size: integers beyond 64 bits, any JSON value). The process dies with the
one that started it: a parent-death signal on Linux, and a watchdog thread everywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import inspect
import os
import pickle
import signal
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import IO, Any

from rollflow.settings import redact

HEADER = struct.Struct("!I")
READY = "ready"
MAX_ERROR_CHARS = 2000  # an error's text in a reply: enough to read, never a pipe's worth
PR_SET_PDEATHSIG = 1
WATCH_S = 0.5

CheckFn = Callable[[dict[str, Any], str], Any]


def frame(message: object) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def send(stream: IO[bytes], message: object) -> None:
    stream.write(frame(message))
    stream.flush()


def read_exactly(stream: IO[bytes], size: int) -> bytes:
    """`size` bytes, or EOFError when the other side closed first."""
    chunks, left = [], size
    while left:
        data = stream.read(left)
        if not data:
            raise EOFError("the other side closed the pipe")
        chunks.append(data)
        left -= len(data)
    return b"".join(chunks)


def receive(stream: IO[bytes]) -> Any:
    (size,) = HEADER.unpack(read_exactly(stream, HEADER.size))
    return pickle.loads(read_exactly(stream, size))


def resolve(spec: str) -> CheckFn:
    """The synchronous check a verifier spec names (built-ins by name, else module:function)."""
    if spec == "math":
        from rollflow.tasks.verify.mathcheck import math_verify_match, warm_up

        warm_up()
        return math_verify_match
    import importlib

    module_name, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module_name), attr)  # type: ignore[no-any-return]


def settle(value: Any, loop: asyncio.AbstractEventLoop | None = None) -> Any:
    """A synchronous check's value; one that returns an awaitable is awaited, as on the thread path."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value

    runner = loop or asyncio.new_event_loop()
    try:
        return runner.run_until_complete(wait())
    finally:
        if loop is None:
            runner.close()


def die_with(parent: int) -> None:
    """Exit as soon as the process that started this one is gone, whatever a check is doing."""
    with contextlib.suppress(Exception):  # Linux: the kernel sends SIGKILL, even to a check holding the GIL
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCH_S)
        os._exit(1)

    if os.getppid() != parent:
        os._exit(1)  # the parent died before the signal was armed
    threading.Thread(target=watch, name="rollflow-verify-watch", daemon=True).start()


def error_text(exc: BaseException) -> str:
    text = redact.redact(f"{type(exc).__name__}: {exc}")
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + " [...]"


def serve(spec: str, parent: int) -> None:
    die_with(parent)
    # The pool stops its workers itself: a Ctrl-C meant for the command must not fail their checks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inbox = sys.stdin.buffer
    outbox = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a verifier's print() must not corrupt replies
    redact.register(None, *receive(inbox))  # the collecting process's secrets, first on the pipe
    sys.stdout = sys.stderr = redact.RedactedStream(sys.stderr)
    try:
        check = resolve(spec)
    except BaseException as exc:  # told to the pool once, instead of a traceback per relaunch
        where = traceback.extract_tb(exc.__traceback__)[-1]
        send(outbox, ("failed", f"{error_text(exc)} ({where.filename}, line {where.lineno})"))
        return
    send(outbox, READY)
    loop = asyncio.new_event_loop()
    while True:
        try:
            row, text = receive(inbox)
        except EOFError:
            return
        cpu = time.process_time()
        try:
            status, value = "ok", float(settle(check(row, text), loop))
        except BaseException as exc:  # sys.exit() or KeyboardInterrupt in a check fails that check alone
            status, value = "error", error_text(exc)
        send(outbox, (status, value, time.process_time() - cpu))


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else os.getppid())
