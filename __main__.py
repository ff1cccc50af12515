"""`python -m stagemesh` == the `stagemesh` command."""

from stagemesh.cli import main

main()
