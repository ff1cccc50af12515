"""The seed a request gets when its client gives none."""

from __future__ import annotations

import random

#: Picked seeds stay below 2**31, so they read the same in every client language.
RANDOM_SEEDS = 2**31


def random_seed() -> int:
    return random.randrange(RANDOM_SEEDS)
