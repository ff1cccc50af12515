"""Mid-step abort for a DiT: a pre-hook on every transformer block asks the engine's
`StepInterrupt` whether the whole batch has been cancelled, and raises `StepInterrupted` there.

A step mutates no state before its forwards end, so a forward stopped between blocks leaves
every state as it was (the `StageAdapter.step` contract). One owner for the hooks of a stage,
whichever transformers it runs (Wan 2.2 has two: both get them).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from stagemesh.shared.devices import LaunchPacer
from stagemesh.shared.engine.interrupt import StepInterrupt


class BlockInterruptHooks:
    """The interrupt checks of a stage's transformer blocks; binding again replaces them."""

    def __init__(self, pacer: LaunchPacer) -> None:
        """pacer: marked at every block, so the checks stay close to what the device computes
        (the adapter resets it before each forward)."""
        self._pacer = pacer
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def bind(self, interrupt: StepInterrupt, blocks: Iterable[torch.nn.Module]) -> None:
        """Check `interrupt` before each of `blocks` (any hooks bound before are removed)."""
        for handle in self._handles:
            handle.remove()

        def check(module: torch.nn.Module, args: tuple[object, ...]) -> None:
            self._pacer.mark()
            interrupt.check()

        self._handles = [block.register_forward_pre_hook(check) for block in blocks]
