"""What the CLI owns about failure: exit codes, the errors it shows as one paragraph, and quiet logs."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import ValidationError
    from rich.console import Console

    from rollflow.settings import RollflowSettings
    from rollflow.settings.models import EngineSettings

EXIT_OK, EXIT_INCOMPLETE, EXIT_ERROR = 0, 1, 2
# Stopped by a signal, as shells report it (128 + the signal): Ctrl-C 130, SIGTERM 143.
EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143


class Terminated(KeyboardInterrupt):
    """SIGTERM outside a flow run (Prefect raises its own TerminationSignal inside one): stop like Ctrl-C."""


def terminate_like_ctrl_c() -> None:
    """From now on SIGTERM stops the command as Ctrl-C does, instead of killing it without a word."""
    import signal

    def handler(signum: int, frame: object) -> None:
        raise Terminated()

    signal.signal(signal.SIGTERM, handler)


def stderr_console() -> Console:
    """The CLI's console. Its text is never read as Rich markup: a path, URL or server message holding
    `[/x]` crashed the error's own printing, and `[exp1]` vanished from the path it named."""
    from rich.console import Console

    return Console(stderr=True, markup=False)


def styled(text: str, style: str) -> Any:
    """A prefix in a style (the console takes no markup)."""
    from rich.text import Text

    return Text(text, style=style)


class UsageError(Exception):
    """A flag or argument the user must change; the message says how."""


def print_error(console: Console, exc: BaseException) -> None:
    """A user error (or an incomplete run) as one paragraph, the process's secrets masked."""
    from rollflow.settings import redact

    console.print(styled("rollflow:", "bold red"), redact.redact(str(exc)), highlight=False, soft_wrap=True)


def _tree(exc: BaseException) -> list[BaseException]:
    """`exc`, then what it groups and what it was raised from, each once (not what it was raised while
    handling: a defect met while handling a user's error is the defect, with its traceback)."""
    seen: dict[int, BaseException] = {}
    todo = [exc]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen[id(current)] = current
        if isinstance(current, BaseExceptionGroup):
            todo.extend(current.exceptions)
        if current.__cause__ is not None:
            todo.append(current.__cause__)
    return list(seen.values())


def print_failure(
    console: Console, exc: BaseException, known: tuple[type[BaseException], ...], kept: str
) -> int:
    """How a command that ran a flow failed, and its exit status: a `known` user error as one paragraph
    (EXIT_ERROR), Ctrl-C or SIGTERM as one line saying `kept` are kept (130, 143); anything else re-raised."""
    from rollflow.flows.stops import signal_stop_in

    said = next((e for e in _tree(exc) if isinstance(e, known)), None)  # also inside a task group
    if said is not None:
        print_error(console, said)
        return EXIT_ERROR
    from rollflow.tasks.storage.store import describe_error, storage_full

    disk = storage_full(exc)
    if disk is not None:  # ENOSPC committing a chunk, writing the audit or the card: not a traceback
        where = disk.filename or "the output"
        said = describe_error(str(where), disk, "choose another --output")
        print_error(console, RuntimeError(f"Writing {where} failed: {said}. {kept} are kept; run the same "
                                          "command again once there is room."))  # fmt: skip
        return EXIT_ERROR
    stop = signal_stop_in(exc)
    if stop is None:
        raise exc
    interrupt = isinstance(stop, KeyboardInterrupt) and not isinstance(stop, Terminated)
    console.print(
        styled("rollflow:", "bold yellow"),
        f"{'interrupted' if interrupt else 'terminated (SIGTERM)'}. {kept} are "
        "kept; run the same command again to resume.",
        highlight=False,
        soft_wrap=True,
    )
    return EXIT_INTERRUPTED if interrupt else EXIT_TERMINATED


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors with a message written for the user: printed as one paragraph, exit status EXIT_ERROR.

    Imported when called, so the CLI's start (and `rollflow simulate`) does not load the tasks.
    """
    from rollflow.flows.cli.local_server import LocalServerError
    from rollflow.flows.secrets import SecretBlockError
    from rollflow.tasks.backends.head_server import HeadServerError
    from rollflow.tasks.backends.preflight import BackendUnreachable
    from rollflow.tasks.collect.rows import InputError
    from rollflow.tasks.storage.lease import LeaseHeld, LeaseLost
    from rollflow.tasks.storage.ledger import IdentityMismatch
    from rollflow.tasks.storage.store import StorageError
    from rollflow.tasks.tuning.fail_fast import BackendRejects, TuningError
    from rollflow.tasks.verify.verifiers import VerifierError

    return (
        InputError,
        StorageError,
        IdentityMismatch,
        BackendUnreachable,
        HeadServerError,
        VerifierError,
        SecretBlockError,
        LeaseHeld,
        LeaseLost,
        TuningError,
        BackendRejects,  # named too: the console filter matches Prefect's words by the class's own name
        LocalServerError,
    )


# Prefect's words for a task or flow that a Ctrl-C or SIGTERM stopped (which it says depends on where the
# signal found the task); the CLI says it in one line.
STOPPED_BY_SIGNAL = ("cancelled by the runtime environment", "aborted by a termination signal")


class HideKnownErrors(logging.Filter):
    """Console only: drop Prefect's records of an expected error, which rollflow reports in one paragraph.

    Prefect logs a failed task or flow with its traceback, then its Failed state; the API handler (the
    Prefect UI) still gets both, and the run's state stays Failed with the message.
    """

    def __init__(self, known: tuple[type[BaseException], ...]) -> None:
        super().__init__()
        self.known = known
        self.names = tuple(f"exception {t.__name__}: " for t in known)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            return not isinstance(record.exc_info[1], self.known)
        if not record.name.startswith("prefect"):
            return True
        message = record.getMessage().replace("exception: ", "exception ")
        if any(phrase in message for phrase in STOPPED_BY_SIGNAL):
            return False
        return not any(name in message for name in self.names)


@contextmanager
def known_errors_quiet(known: tuple[type[BaseException], ...], verbose: bool) -> Iterator[None]:
    """Install HideKnownErrors on Prefect's console handlers (none with --verbose) while a flow runs."""
    from prefect.logging.handlers import PrefectConsoleHandler

    hide = HideKnownErrors(known)
    handlers = [] if verbose else logging.getLogger().handlers
    consoles = [h for h in handlers if isinstance(h, PrefectConsoleHandler)]
    for handler in consoles:
        handler.addFilter(hide)
    try:
        yield
    finally:
        for handler in consoles:
            handler.removeFilter(hide)


def quiet_prefect(verbose: bool) -> None:
    """Prefect's INFO logs would fight the progress bar; they stay in the Prefect UI either way."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("PREFECT_LOGGING_SERVER_LEVEL", "ERROR")
        # A run that ends unpublished is reported below in one paragraph, not as a flow traceback.
        os.environ.setdefault("PREFECT_LOGGING_LOGGERS_PREFECT_FLOW_RUNS_LEVEL", "CRITICAL")


def check_engine(spec: EngineSettings) -> None:
    """A remote runner that cannot start here is a usage error before anything runs; a flag the runner
    ignores is said on stderr."""
    from rollflow.flows.engines import engine_notes, engine_problem
    from rollflow.settings import redact

    if spec.runner != "local" and (problem := engine_problem(spec)):
        raise UsageError(problem)
    for note in engine_notes(spec):
        print(f"rollflow: {redact.redact(note)}", file=sys.stderr)


def _unparsable_json_settings() -> list[str]:
    """The ROLLFLOW_* variables (environment, then .env) of object-valued settings that are not JSON."""
    import json

    from dotenv import dotenv_values

    from rollflow.settings import RollflowSettings

    names = [
        f"ROLLFLOW_{group.upper()}__{name.upper()}"
        for group, info in RollflowSettings.model_fields.items()
        for name, field in getattr(info.annotation, "model_fields", {}).items()
        if getattr(field.annotation, "__origin__", field.annotation) is dict
    ]
    found = []
    dotenv = {k.upper(): v for k, v in dotenv_values(".env").items()} if os.path.exists(".env") else {}
    for name in names:
        source, value = (
            ("environment", os.environ.get(name)) if name in os.environ else (".env", dotenv.get(name))
        )
        if value is None:
            continue
        try:
            json.loads(value)
        except ValueError as exc:
            example = '{"temperature": 0.7}'
            found.append(
                f"{name} in the {source} is not valid JSON ({exc}); pass an object, e.g. '{example}'"
            )
    return found


def load_settings() -> RollflowSettings:
    """The ROLLFLOW_* settings; a bad value in the environment or .env is a UsageError naming the variable."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from rollflow.settings import RollflowSettings

    try:
        return RollflowSettings()
    except SettingsError as exc:
        problems = "; ".join(_unparsable_json_settings()) or str(exc)
        raise UsageError(f"Invalid setting: {problems}. Fix or unset it.") from None
    except ValidationError as exc:
        problems = validation_problems(exc, lambda loc: f"ROLLFLOW_{'__'.join(loc).upper()}")
        raise UsageError(f"Invalid setting in the environment or .env: {problems}. Fix or unset it.") from exc


_TYPE_TAGS = {"int", "str", "float", "bool", "dict", "list", "none"}


def _is_member_tag(part: object) -> bool:
    """A union member's tag in an error's location (`constrained-int`, `literal['auto']`), not a field."""
    return isinstance(part, str) and ("[" in part or "-" in part or part in _TYPE_TAGS)


def validation_problems(exc: ValidationError, name: Callable[[list[str]], str]) -> str:
    """One problem per field: a value that fits no member of a union (a number or `auto`) is said once,
    with what each member expected, under the field's own name."""
    by_field: dict[tuple[str, ...], list[str]] = {}
    for error in exc.errors():
        loc = tuple(str(part) for part in error["loc"] if not _is_member_tag(part))
        by_field.setdefault(loc, []).append(error["msg"].removeprefix("Value error, "))
    return "; ".join(
        "".join(f"{label}: " for label in [name(list(loc))] if label)  # none for a rule over two fields
        + ", or ".join(m if i == 0 else m[:1].lower() + m[1:] for i, m in enumerate(msgs))
        for loc, msgs in by_field.items()
    )
