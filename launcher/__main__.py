"""`python -m stagemesh.launcher --fd N`: the launcher process (started by serve only)."""

import sys

from stagemesh.launcher.server import main

main(sys.argv[1:])
