"""A worker process counts the cluster's worker processes on its node to size its verifier pool: a count
that fails is asked again, and one that fails every time says so (the pool then takes the whole node)."""

from __future__ import annotations

import asyncio
import logging
import time

import distributed  # noqa: F401  (imported, as in a flow that ran Dask: this process is still no worker)
import pytest

from rollflow.tasks.scaleout import node


def test_a_count_that_fails_is_asked_again():
    answers = [ConnectionError("scheduler busy"), TimeoutError("no answer"), 3]

    def count() -> int:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert node._asked(count) == 3 and not answers


def test_a_count_that_always_fails_says_so(caplog):
    def count() -> int:
        raise ConnectionError("scheduler gone")

    with caplog.at_level(logging.WARNING, logger=node.__name__):
        assert node._asked(count) == 1
    assert "could not count this node's worker processes" in caplog.text and "scheduler gone" in caplog.text


@pytest.mark.alone  # asserts < 0.15 s
def test_outside_a_worker_process_the_count_is_one_at_once(caplog):
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=node.__name__):
        assert node.node_sharers() == 1
    assert time.monotonic() - started < 0.15 and not caplog.text


async def test_a_dask_worker_whose_client_is_asynchronous_counts_every_worker_on_its_node():
    """The count goes through the worker's own connection to the scheduler, whatever client the worker has
    (an asynchronous client's `scheduler_info`, called on its loop, answers from a cache listing no
    worker: counted so, the pool would take the whole node)."""
    from distributed import Scheduler, Worker

    async with (
        Scheduler(host="127.0.0.1", port=0, dashboard=False, dashboard_address=None) as scheduler,
        Worker(scheduler.address, host="127.0.0.1", dashboard=False) as worker,
        Worker(scheduler.address, host="127.0.0.1", dashboard=False),
    ):
        worker._get_client()  # made on the worker's loop: asynchronous
        assert worker.client.asynchronous
        assert await asyncio.to_thread(node._dask_sharers) == 2
