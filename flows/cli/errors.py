"""What the CLI owns about failure: exit codes, the errors it shows as one paragraph, and quiet logs."""

from __future__ import annotations

import os

EXIT_OK, EXIT_INCOMPLETE, EXIT_ERROR = 0, 1, 2


class UsageError(Exception):
    """A flag or argument the user must change; the message says how."""


def user_errors() -> tuple[type[BaseException], ...]:
    """Errors with a message written for the user: printed as one paragraph, exit status EXIT_ERROR.

    Imported when called, so the CLI's start (and `rollflow simulate`) does not load the tasks.
    """
    from rollflow.flows.secrets import SecretBlockError
    from rollflow.tasks.collect.preflight import BackendUnreachable
    from rollflow.tasks.collect.rows import InputError
    from rollflow.tasks.collect.verifiers import VerifierError
    from rollflow.tasks.storage.lease import LeaseHeld, LeaseLost
    from rollflow.tasks.storage.ledger import IdentityMismatch
    from rollflow.tasks.storage.store import StorageError

    return (
        InputError,
        StorageError,
        IdentityMismatch,
        BackendUnreachable,
        VerifierError,
        SecretBlockError,
        LeaseHeld,
        LeaseLost,
    )


def quiet_prefect(verbose: bool) -> None:
    """Prefect's INFO logs would fight the progress bar; they stay in the Prefect UI either way."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
        os.environ.setdefault("PREFECT_LOGGING_SERVER_LEVEL", "ERROR")
        os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
        # A run that ends unpublished is reported below in one paragraph, not as a flow traceback.
        os.environ.setdefault("PREFECT_LOGGING_LOGGERS_PREFECT_FLOW_RUNS_LEVEL", "CRITICAL")
