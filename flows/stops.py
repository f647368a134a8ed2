"""Ctrl-C and SIGTERM inside a flow: finding the signal's exception in whatever Prefect raised for it."""

from __future__ import annotations


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
