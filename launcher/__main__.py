"""`python -m stagemesh.launcher --fd N`: the launcher process (started by serve only)."""

import sys

from stagemesh.launcher.server import main

if __name__ == "__main__":  # importing it (a walk over every module) starts nothing
    main(sys.argv[1:])
