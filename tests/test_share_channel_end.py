"""A run's end on the share channel: the flow removes the run's state without waiting for its workers, a
report a worker writes after that is deleted by the worker itself, an exchange with nothing to report
only reads, and the book's answer is published only when it changes."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from share_board import ShareBoard

from rollflow.infra.local import free_port
from rollflow.tasks.scaleout.board import Board
from rollflow.tasks.scaleout.channels import GONE, PREFIX, DaskChannel, DaskLink


@pytest.fixture
def client() -> Iterator[Any]:
    """A real scheduler on loopback (no workers: the exchanges are made from this process)."""
    from distributed import Client, LocalCluster

    with (
        LocalCluster(n_workers=0, host="127.0.0.1", dashboard_address=None) as cluster,
        Client(cluster, timeout=30) as client,
    ):
        yield client


@pytest.mark.alone  # asserts close < 0.4 s
def test_the_run_ends_without_waiting_and_a_late_report_is_deleted_by_its_worker(client: Any) -> None:
    channel, link = DaskChannel(client, "run1"), DaskLink("run1", client)
    channel.publish({"grants": {"w": (1, 8)}, "rotation": {}})
    assert link.exchange("w", {"n": 1, "demand": 10}) == {"grants": {"w": (1, 8)}, "rotation": {}}
    began = time.monotonic()
    channel.close()
    took = time.monotonic() - began
    assert client.get_metadata([PREFIX], None) is None
    # The worker's exchange was under way: its report lands after the run's state was removed.
    assert link.exchange("w", {"n": 2, "demand": 3}) == GONE
    assert client.get_metadata([PREFIX], None) is None, "the late report was left on the scheduler"
    assert took < 0.4, f"closing waited {took:.2f} s for the workers (it used to sleep 0.5 s)"


def test_an_exchange_without_a_report_only_reads(client: Any) -> None:
    """Nothing new to say: the board is read, the report written last stays as it was, and the end of the
    run is found as with a report (and leaves nothing)."""
    channel, link = DaskChannel(client, "run4"), DaskLink("run4", client)
    assert link.exchange("w", None) is None  # no board yet: no answer, nothing written
    channel.publish({"grants": {"w": (1, 8)}})
    assert link.exchange("w", None) == {"grants": {"w": (1, 8)}}
    assert channel.reports() == {}, "a read wrote a report"
    assert link.exchange("w", {"n": 1, "demand": 10}) == {"grants": {"w": (1, 8)}}
    channel.publish({"grants": {"w": (2, 4)}})
    assert link.exchange("w", None) == {"grants": {"w": (2, 4)}}
    assert channel.reports() == {"w": {"n": 1, "demand": 10}}
    channel.close()
    assert link.exchange("w", None) == GONE
    assert client.get_metadata([PREFIX], None) is None


class ClosedMidExchange(DaskLink):
    """A link whose first read of the board is followed by the flow closing the run, before the write."""

    def _read(self) -> dict[str, Any] | None:
        board = super()._read()
        if board is not None and not board.get("closed"):
            DaskChannel(self.client, self.key).close()
        return board


def test_a_worker_that_has_not_seen_the_board_leaves_nothing(client: Any) -> None:
    """Before a worker has read a live board of the run it writes nothing (a run that ended first, or
    whose book has not published yet); a write that straddles the end is deleted in the same exchange."""
    late = DaskLink("run2", client)
    DaskChannel(client, "run2").publish({"grants": {}})
    DaskChannel(client, "run2").close()
    for n in range(3):
        assert late.exchange("w", {"n": n}) is None
    assert client.get_metadata([PREFIX], None) is None
    straddling = ClosedMidExchange("run3", client)
    DaskChannel(client, "run3").publish({"grants": {}})
    # It read the board live, the run ended, then its report landed: found at once, not at a next
    # exchange that may never come (its slot closes when the run is past its deadline).
    assert straddling.exchange("w", {"n": 1}) == GONE
    assert client.get_metadata([PREFIX], None) is None
    assert straddling.exchange("w", {"n": 2}) is None  # and it writes nothing more
    assert client.get_metadata([PREFIX], None) is None


HIDDEN_SCHEDULER = """
import sys
sys.modules["rollflow"] = None  # a scheduler host without rollflow installed
from distributed.cli.dask_scheduler import main
sys.argv = ["dask-scheduler", "--host", "127.0.0.1", "--port", sys.argv[1], "--no-dashboard"]
main()
"""


def test_the_scheduler_needs_no_rollflow_to_forget_a_run(tmp_path: Path) -> None:
    from distributed import Client

    port = free_port()
    log = (tmp_path / "scheduler.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-c", HIDDEN_SCHEDULER, str(port)], stdout=log, stderr=log)
    try:
        with Client(f"tcp://127.0.0.1:{port}", timeout=30) as client:
            assert client.run_on_scheduler(
                lambda: "rollflow" in sys.modules and sys.modules["rollflow"] is None
            )
            channel, link = DaskChannel(client, "run4"), DaskLink("run4", client)
            channel.publish({"grants": {}})
            assert link.exchange("w", {"n": 1}) == {"grants": {}}
            channel.close()
            assert link.exchange("w", {"n": 2}) == GONE
            assert client.get_metadata([PREFIX], None) is None
    finally:
        proc.kill()
        proc.wait(10)
        log.close()


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


@pytest.mark.concurrent
def test_a_round_goes_on_when_a_workers_report_is_gone() -> None:
    """A worker deletes its own report when it finds the run ended; the book still knows it until LOST_S."""
    channel = CountingBoard()
    board = Board(channel, {"http://a": 32}, asyncio.new_event_loop())
    channel.exchange("w", {"n": 1, "demand": 10, "chunks": {"0": [1, 0]}})
    board.round()
    channel._reports.clear()
    board.round()
    assert "w" in board.book.workers
