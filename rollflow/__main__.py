"""`python -m rollflow`: the same command as `rollflow`."""

from rollflow.flows.cli.main import main

raise SystemExit(main())
