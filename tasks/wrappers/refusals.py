"""Refusals: usage errors a served run meets (its parameters, input, output, backend), said in one line.

A task that meets one returns it as a value (`Refusal`) instead of raising, so Prefect's task engine logs no
traceback in the run's Logs tab; the flow raises it again (`unrefused`) and ends FAILED with its message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from pydantic import ValidationError

from rollflow.tasks.backends.head_server import HeadServerError
from rollflow.tasks.backends.preflight import BackendUnreachable
from rollflow.tasks.collect.rows import InputError
from rollflow.tasks.storage.lease import LeaseHeld
from rollflow.tasks.storage.ledger import IdentityMismatch
from rollflow.tasks.storage.store import StorageError

REFUSALS: tuple[type[BaseException], ...] = (
    ValidationError,
    InputError,
    HeadServerError,
    BackendUnreachable,
    StorageError,
    LeaseHeld,
    IdentityMismatch,
)

T = TypeVar("T")


@dataclass(frozen=True)
class Refusal:
    """A refusal a task met, carried out of it as its result."""

    error: BaseException


def unrefused(value: T | Refusal) -> T:
    """The task's result, or its refusal raised again in the flow."""
    if isinstance(value, Refusal):
        raise value.error
    return value
