"""Ctrl-C and SIGTERM inside a flow: finding the signal's exception in whatever Prefect raised for it."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

from rollflow.tasks.storage.store import StorageFull
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
    if isinstance(exc, StorageFull):  # every chunk would fail alike: the run stops, its work kept
        raise exc
    return exc


RECANCEL_S = 5.0  # a stop not done this long after its cancel is cancelled again


async def cancelled_by_sigterm(body: Coroutine[Any, Any, T]) -> T:
    """Run a flow's body so that Ctrl-C and SIGTERM cancel it where it awaits, then raise the signal's
    exception (KeyboardInterrupt, Prefect's TerminationSignal).

    Prefect's SIGTERM handler raises into whatever the main thread runs. Inside an asyncio callback
    (aiohttp reading a reply) or a task's step, that exception is logged or kept as the task's result,
    and the run waits on: behind a hung check, for as long as the check's timeout. Ctrl-C's one
    cancellation can be lost the same way (an awaited result that landed in the same step keeps it), and
    a served run then collected on for minutes: so a stop not done within RECANCEL_S is cancelled again.
    """
    from prefect.exceptions import TerminationSignal

    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(body)
    received: list[int] = []

    def recancel() -> None:
        if not task.done():
            task.cancel()
            loop.call_later(RECANCEL_S, recancel)

    def on_signal(signum: int, frame: object) -> None:
        received.append(signum)
        loop.call_soon_threadsafe(recancel if len(received) == 1 else task.cancel)

    # A runner that started this run over its control channel cancels it by SIGTERM through Prefect's
    # own handler, which only that handler can acknowledge; Ctrl-C is always this body's.
    signals = [signal.SIGINT] + ([] if _runner_controls_this_run() else [signal.SIGTERM])
    try:
        previous = {sig: signal.signal(sig, on_signal) for sig in signals}
    except ValueError:  # not the main thread (a flow run on a worker's thread): no signal reaches it
        return await task
    try:
        return await task
    except asyncio.CancelledError:
        if received and received[0] == signal.SIGINT:
            raise KeyboardInterrupt from None
        if received:
            raise TerminationSignal(signal=signal.SIGTERM) from None
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
