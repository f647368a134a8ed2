"""An in-process share channel (tasks/scaleout/channels.py carries the same exchanges through an engine)."""

from __future__ import annotations

from typing import Any


class ShareBoard:
    """Both sides of a share channel in one process: the newest report of each worker and the book's
    newest answer, for driving collectors and the book without an engine."""

    def __init__(self) -> None:
        self._reports: dict[str, dict[str, Any]] = {}
        self._board: dict[str, Any] | None = None

    def exchange(self, worker: str, report: dict[str, Any] | None) -> dict[str, Any] | None:
        if report is not None:
            self._reports[worker] = report
        return self._board

    def reports(self) -> dict[str, dict[str, Any]]:
        return dict(self._reports)

    def publish(self, board: dict[str, Any]) -> None:
        self._board = board
