"""A run's end on the share channel: the flow removes the run's state without waiting for its workers, a
report a worker writes after that is deleted by the worker itself, and the book's answer is published
only when it changes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from share_board import ShareBoard

from rollflow.tasks.scaleout.board import Board
from rollflow.tasks.scaleout.channels import CLOSED, PREFIX, DaskChannel, DaskLink


@pytest.fixture
def client() -> Iterator[Any]:
    """A real scheduler on loopback (no workers: the exchanges are made from this process)."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(n_workers=0, host="127.0.0.1", dashboard_address=None) as cluster,
        Client(cluster, timeout=30) as client,
    ):
        yield client


def test_the_run_ends_without_waiting_and_a_late_report_is_deleted_by_its_worker(client: Any) -> None:
    channel, link = DaskChannel(client, "run1"), DaskLink("run1", client)
    channel.publish({"grants": {"w": (1, 8)}, "rotation": {}})
    assert link.exchange("w", {"n": 1, "demand": 10}) == {"grants": {"w": (1, 8)}, "rotation": {}}
    began = time.monotonic()
    channel.close()
    took = time.monotonic() - began
    assert client.get_metadata([PREFIX], None) is None
    # The worker's exchange was under way: its report lands after the run's state was removed.
    assert link.exchange("w", {"n": 2, "demand": 3}) == CLOSED
    assert client.get_metadata([PREFIX], None) is None, "the late report was left on the scheduler"
    assert took < 0.4, f"closing waited {took:.2f} s for the workers (it used to sleep 0.5 s)"


def test_a_report_before_the_first_board_is_kept(client: Any) -> None:
    """A run whose book has not published yet is starting, not ended: the report stays for the book."""
    link = DaskLink("run2", client)
    assert link.exchange("w", {"n": 1, "demand": 10}) is None
    assert DaskChannel(client, "run2").reports() == {"w": {"n": 1, "demand": 10}}


class CountingBoard(ShareBoard):
    def __init__(self) -> None:
        super().__init__()
        self.published: list[dict[str, Any]] = []

    def publish(self, board: dict[str, Any]) -> None:
        self.published.append(board)
        super().publish(board)


@pytest.mark.concurrent
def test_the_book_publishes_its_answer_only_when_it_changes() -> None:
    channel = CountingBoard()
    board = Board(channel, {"http://a": 32}, asyncio.new_event_loop())
    for n in range(1, 4):  # a worker with steady work: the same answer every round
        channel.exchange("w", {"n": n, "demand": 1000, "applied_seq": 1, "applied": 32, "in_use": 32})
        board.round()
    assert len(channel.published) == 1, channel.published
    channel.exchange("v", {"n": 1, "demand": 1000})  # another worker joins: w is told to shrink
    board.round()
    assert len(channel.published) == 2
    assert channel.published[-1]["grants"]["w"][1] == 16
