from infra.simulator.server import main

raise SystemExit(main())
