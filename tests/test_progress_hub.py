"""A progress listener's failure is the display's problem: it never fails the chunk that emitted."""

from __future__ import annotations

import logging

import pytest

from rollflow.tasks.collect.progress import ProgressEvent, ProgressHub


def test_listener_error_is_logged_once_and_dropped(caplog: pytest.LogCaptureFixture) -> None:
    hub, seen = ProgressHub(), []

    def broken(event: ProgressEvent) -> None:
        raise RuntimeError(f"display broke at {event.done}")

    hub.subscribe(broken)
    hub.subscribe(seen.append)
    with caplog.at_level(logging.WARNING, logger="rollflow.tasks.collect.progress"):
        for done in range(1, 4):
            hub.emit(ProgressEvent("rollouts", done=done))
    assert [e.done for e in seen] == [1, 2, 3]
    errors = [r for r in caplog.records if r.exc_info]
    assert len(errors) == 1 and "broken" in errors[0].getMessage()
    assert "display broke at 1" in str(errors[0].exc_info[1])
