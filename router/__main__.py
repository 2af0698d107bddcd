"""`python -m router` is `fleet-router`."""

from router.cli import main

raise SystemExit(main())
