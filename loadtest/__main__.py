"""``python -m loadtest ...`` is ``fleet-loadtest ...``."""

import sys

from loadtest.cli import main

sys.exit(main())
