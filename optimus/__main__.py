"""`python -m optimus` is the `optimus` command."""

import sys

from optimus.cli import main

sys.exit(main())
