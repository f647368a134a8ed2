"""One verifier process: reads (row, text) checks from stdin, writes rewards to stdout, one at a time.

Run as `python -m rollflow.tasks.verify.worker SPEC` by the verify pool. It is a plain subprocess,
not a multiprocessing child, so Dask's daemonic workers may start it too. Checks run in the process's
main thread, where math-verify's SIGALRM timeouts work. Messages are a 4-byte length and a pickle.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from rollflow.settings import redact

HEADER = struct.Struct("!I")
READY = "ready"

CheckFn = Callable[[dict[str, Any], str], Any]


def send(stream: IO[bytes], message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(data)) + data)
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


def serve(spec: str) -> None:
    # The pool stops its workers itself: a Ctrl-C meant for the command must not fail their checks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inbox = sys.stdin.buffer
    outbox = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a verifier's print() must not corrupt replies
    redact.register(None, *receive(inbox))  # the collecting process's secrets, first on the pipe
    sys.stdout = sys.stderr = redact.RedactedStream(sys.stderr)
    check = resolve(spec)
    send(outbox, READY)
    while True:
        try:
            row, text = receive(inbox)
        except EOFError:
            return
        cpu = time.process_time()
        try:
            status, value = "ok", float(check(row, text))
        except Exception as exc:
            status, value = "error", redact.redact(f"{type(exc).__name__}: {exc}")
        send(outbox, (status, value, time.process_time() - cpu))


if __name__ == "__main__":
    serve(sys.argv[1])
