"""`python -m optimus.cli`, as the `optimus` command."""

import sys

from optimus.cli.main import main

sys.exit(main())
