"""The simulated inference backend: a real HTTP server with a capacity model and fault injection."""

from rollflow.infra.simulator.cli import main
from rollflow.infra.simulator.config import SimConfig
from rollflow.infra.simulator.server import RunningSimulator, build_app, start_simulator

__all__ = ["RunningSimulator", "SimConfig", "build_app", "main", "start_simulator"]
