"""Operator options that limit a stage: never looser than what the model itself allows."""

from __future__ import annotations

import logging
from typing import TypeVar

logger = logging.getLogger(__name__)

#: int for counts and sizes, float for scales.
Number = TypeVar("Number", int, float)


def capped_option(name: str, value: Number, model_cap: Number | None = None) -> Number:
    """`value` (an operator's option, which must be positive), lowered to `model_cap` if above.

    A higher value is not an error: the operator asked for "as much as possible", the stage
    takes what the model allows and publishes that. `model_cap` None: the model sets no cap.
    """
    if not value > 0:
        raise ValueError(f"option {name} must be > 0, got {value}")
    if model_cap is not None and value > model_cap:
        logger.warning("option %s=%s is above the model's limit; using %s", name, value, model_cap)
        return model_cap
    return value
