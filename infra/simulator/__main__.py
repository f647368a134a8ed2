"""`python -m rollflow.infra.simulator --port P`: the simulated backend as its own process."""

from rollflow.infra.simulator.cli import main

raise SystemExit(main())
