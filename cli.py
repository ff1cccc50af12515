"""`stagemesh` command line (filled in as features land)."""
def main() -> None:
    raise SystemExit("not yet")
