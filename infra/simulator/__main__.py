"""`python -m infra.simulator --port P`: the simulated backend as its own process."""

from infra.simulator.server import main

raise SystemExit(main())
