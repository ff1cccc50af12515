"""The training harness the tiny-shapes models share (tiny-shapes, tiny-shapes-edit,
tiny-shapes-video and the LoRA): threads, timed phases, the optimiser step and its schedule, the
EMA of the trained weights, and the load average a run records.

Each model's `train` keeps what is its own (data, components, loss); the loop around the loss is
here, so one seed gives the same weights whichever model's code runs it. The order of every
random draw and every update is the one the shipped models were trained with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NoReturn, TypeVar

import numpy as np
import torch

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
    from tqdm import tqdm

logger = logging.getLogger(__name__)
T = TypeVar("T")
C = TypeVar("C", bound="DataclassInstance")

#: Every optimiser here: AdamW without weight decay (the schedule sets the lr each step).
BETAS = (0.9, 0.95)
#: Steps between two progress reports (loss logged, load average sampled).
REPORT_EVERY = 50


def cosine_lr(step: int, total: int, warmup: int) -> float:
    """The lr factor at `step`: linear warmup over `warmup` steps, then a cosine to 0."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def progress(total: int, desc: str) -> tqdm[NoReturn]:
    """A progress bar (tqdm is in the `train` extra, so it is imported only when training)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, mininterval=2.0)


def phase(name: str, fn: Callable[[], T], timings: dict[str, float]) -> T:
    """Runs `fn`, records its wall seconds in `timings[name]`."""
    start = time.perf_counter()
    result = fn()
    timings[name] = round(time.perf_counter() - start, 1)
    logger.info("%s done in %.1f s", name, timings[name])
    return result


def with_threads(threads: int, fn: Callable[[], T]) -> T:
    """Runs `fn` with torch on `threads` threads, then restores the caller's count (one thread
    was fastest on a busy 2-core machine)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(previous)


def seeded_generator(seed: int) -> torch.Generator:
    """Seeds torch's global generator (weight init, dropout) and returns the one that draws
    the batches, noise and timesteps."""
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def adamw(params: list[torch.nn.Parameter], lr: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, betas=BETAS, weight_decay=0.0)


def optimiser_step(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                   loss: torch.Tensor, *, lr: float, clip: float) -> None:
    """One update: the lr set, gradients of `loss` clipped to norm `clip`, AdamW's step."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()


def optimise(params: list[torch.nn.Parameter], loss_at: Callable[[int], torch.Tensor], *,
             steps: int, lr: float, warmup: int, clip: float, desc: str,
             after_step: Callable[[int], None] | None = None) -> list[float]:
    """AdamW on `loss_at(step)` with the warmup + cosine schedule and gradient clipping;
    `after_step(step)` runs after each update. Returns the 1-minute load average sampled every
    REPORT_EVERY steps (others may share the machine)."""
    opt = adamw(params, lr)
    load: list[float] = []
    with progress(steps, desc) as bar:
        for step in range(steps):
            loss = loss_at(step)
            optimiser_step(opt, params, loss, lr=lr * cosine_lr(step, steps, warmup), clip=clip)
            if after_step is not None:
                after_step(step)
            bar.update()
            if step % REPORT_EVERY == 0:
                bar.set_postfix(loss=f"{loss.item():.4f}")
                logger.info("%s step %d loss %.4f", desc, step, loss.item())
                load.append(os.getloadavg()[0])
    return load


def load_summary(samples: list[float]) -> dict[str, float]:
    """What training.json records of the load average samples (none when no step ran)."""
    if not samples:
        return {"samples": 0}
    return {"mean": round(float(np.mean(samples)), 2), "max": round(max(samples), 2),
            "samples": len(samples)}


class Ema:
    """An exponential moving average of a module's state, warmed up as (1 + step) / (10 + step)
    until `decay`; what the models ship."""

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        self.module, self.decay = module, decay
        self.state = {k: v.detach().clone() for k, v in module.state_dict().items()}

    @torch.no_grad()
    def update(self, step: int) -> None:
        decay = min(self.decay, (1 + step) / (10 + step))
        for k, v in self.module.state_dict().items():
            self.state[k].lerp_(v, 1.0 - decay)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The EMA weights in the module for the block (a snapshot), the live ones after."""
        live = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        self.module.load_state_dict(self.state)
        try:
            yield
        finally:
            self.module.load_state_dict(live)

    def finish(self) -> None:
        """Leaves the EMA weights in the module, in eval mode."""
        self.module.load_state_dict(self.state)
        self.module.eval()


def with_overrides(config: C, pairs: list[str]) -> C:
    """`config` with each `key=value` of `pairs` replaced (the value read as JSON, then cast to
    the field's type): a training script's `--set`."""
    values = dict(pair.split("=", 1) for pair in pairs)
    return dataclasses.replace(config, **{key: type(getattr(config, key))(json.loads(value))
                                          for key, value in values.items()})
