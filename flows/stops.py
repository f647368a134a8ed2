"""Ctrl-C and SIGTERM inside a flow: finding the signal's exception in whatever Prefect raised for it."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

from rollflow.tasks.wrappers.refusals import REFUSALS

T = TypeVar("T")


def signal_stops() -> tuple[type[BaseException], ...]:
    """What a signal raises in the command: Ctrl-C, SIGTERM before a flow run, and Prefect's in one."""
    from prefect.exceptions import TerminationSignal

    return (KeyboardInterrupt, TerminationSignal)


def signal_stop_in(exc: BaseException) -> BaseException | None:
    """The signal's exception, also when a task group wrapped it or an error was raised while handling
    it (Prefect's crash handling can fail on a task run the signal stopped before it existed)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, BaseExceptionGroup):
            group = current.subgroup(signal_stops())
            while isinstance(group, BaseExceptionGroup):
                group = group.exceptions[0]
            if group is not None:
                return group
        elif isinstance(current, signal_stops()):
            return current
        current = current.__cause__ or current.__context__
    return None


def chunk_error(exc: Exception) -> Exception:
    """A chunk task's error, to be counted as that chunk's failure; re-raises the signal instead when the
    error was raised while a Ctrl-C or SIGTERM unwound the task (the run stops, it does not go on)."""
    stop = signal_stop_in(exc)
    if stop is not None:
        raise stop
    return exc


async def cancelled_by_sigterm(body: Coroutine[Any, Any, T]) -> T:
    """Run a flow's body so that SIGTERM cancels it where it awaits, then raise Prefect's TerminationSignal.

    Prefect's handler raises the signal into whatever the main thread runs. Inside an asyncio callback
    (aiohttp reading a reply) or a task's step, that exception is logged or kept as the task's result,
    and the run waits on: behind a hung check, for as long as the check's timeout.
    """
    from prefect.exceptions import TerminationSignal

    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(body)
    received: list[int] = []
    if _runner_controls_this_run():
        return await task

    def on_sigterm(signum: int, frame: object) -> None:
        received.append(signum)
        loop.call_soon_threadsafe(task.cancel)

    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread (a flow run on a worker's thread): no signal reaches it
        return await task
    try:
        return await task
    except asyncio.CancelledError:
        if received:
            raise TerminationSignal(signal=signal.SIGTERM) from None
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _runner_controls_this_run() -> bool:
    """A Prefect runner (`rollflow serve`, a worker) that started this run over its control channel
    cancels it by telling Prefect's SIGTERM handler first, which only that handler can acknowledge (the
    run then ends Cancelled, not Crashed); and a run that outlives its grace period is killed."""
    from prefect._internal import control_listener

    return getattr(control_listener, "_socket", None) is not None


SERVED_REFUSALS = REFUSALS


def served_refusal(exc: BaseException) -> Any:
    """A FAILED state whose message is the refusal in one line (redacted), with no traceback logged."""
    from prefect.states import Failed
    from pydantic import ValidationError

    from rollflow.settings import redact

    if isinstance(exc, ValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'parameters'}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        )
        text = f"Invalid parameters: {problems}"
    else:
        text = " ".join(str(exc).split())
    return Failed(message=redact.redact(text))
