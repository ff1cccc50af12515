"""The playground page: one page of plain ES modules under a strict CSP (routes.py serves it)."""
