"""The simulated backend in its own process: a reusable starter and session fixtures."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from rollflow.infra.local import Service, spawn_simulator

REPO = Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"rollflow simulator listening on (http://\S+)")


@pytest.fixture(scope="session")
def fast_sim() -> Iterator[Service]:
    """A fast simulator (1 ms latency, 256 slots) shared by the session."""
    sim = spawn_simulator("--latency-ms", "1", "--slots", "256")
    yield sim
    sim.stop()


@pytest.fixture(scope="session")
def simulator(fast_sim: Service) -> str:
    """The fast simulator's URL, for tests that only need where it listens."""
    return fast_sim.url
