"""The simulated backend in its own process, for the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from infra.local import Service, spawn_simulator


@pytest.fixture(scope="session")
def simulator() -> Iterator[str]:
    sim = spawn_simulator("--latency-ms", "1", "--slots", "256")
    yield sim.url
    sim.stop()


@pytest.fixture(scope="session")
def fast_sim() -> Iterator[Service]:
    sim = spawn_simulator("--latency-ms", "1", "--slots", "256")
    yield sim
    sim.stop()
