"""`python -m molora COMMAND ...`: the `molora` command (molora/cli.py)."""

import sys

from molora.cli import main

sys.exit(main())
