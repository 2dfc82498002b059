"""``python -m spdl_lab``: the same command as ``spdl-lab`` (see spdl_lab/cli.py for exit codes)."""

import sys

from .cli import main

if __name__ == "__main__":  # spawned workers re-import the main module; they must not run the command
    sys.exit(main())
