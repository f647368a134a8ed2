"""What a failed attempt on a Dask or Ray worker sends back to the flow: the error itself when the flow can
rebuild it (a builtin's or rollflow's, and it pickles), else its class name and text; never the worker's
frames. A lock inside an error used to fail the whole reply ("Could not serialize object")."""

from __future__ import annotations

import pickle
import threading

import pytest

from rollflow.tasks.storage.lease import LeaseLost
from rollflow.tasks.wrappers.worker_chunks import AttemptFailed, WorkerError, _failed

pytestmark = pytest.mark.concurrent


class HoldsALock(Exception):
    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.lock = threading.Lock()


class FromALibrary(Exception):
    """Stands for an error class only the workers have installed."""


def raised(exc: Exception) -> Exception:
    try:
        raise exc
    except Exception as caught:
        return caught


def sent(exc: Exception) -> Exception:
    reply = pickle.loads(pickle.dumps(_failed(raised(exc))))
    assert isinstance(reply, AttemptFailed) and reply.error.__traceback__ is None
    return reply.error


def test_errors_the_flow_can_rebuild_keep_their_class() -> None:
    assert type(sent(LeaseLost("the lease moved"))) is LeaseLost  # so it is still not retried
    timeout = sent(TimeoutError("the run's deadline"))
    assert type(timeout) is TimeoutError and str(timeout) == "the run's deadline"


@pytest.mark.parametrize("exc", [HoldsALock("holds a lock"), FromALibrary("holds a lock")])
def test_others_travel_as_their_class_name_and_text(exc: Exception) -> None:
    error = sent(exc)
    assert type(error) is WorkerError and str(error) == f"{type(exc).__name__}: holds a lock"
