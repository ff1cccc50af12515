"""The step machine every DiT adapter shares: a request's state and how one step advances it.

A DiT request is a schedule of timesteps fixed in `prepare` (the plan) and what it holds while
it runs (the work: its latents and its own scheduler copy, dropped on release). One `step`
call predicts the noise of every state of a batch (the model's forwards: the adapter's part),
then steps each state's scheduler. Nothing is written to a state until every forward is done,
so a forward that raises (StepInterrupted included) leaves all states as they were; a failing
scheduler step is that state's error output alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch
from diffusers.utils.torch_utils import randn_tensor

from stagemesh.services.dit.lora_slots import LoraHold, SlotBank
from stagemesh.services.dit.preview import Preview, Previewer
from stagemesh.services.dit.step_cache import RowCache, StepCache
from stagemesh.shared.devices import synchronize
from stagemesh.shared.engine.adapter import StepOutput

logger = logging.getLogger(__name__)


class Plan(Protocol):
    """What a request fixes in `prepare`: at least its timesteps, one per denoise step."""

    @property
    def timesteps(self) -> torch.Tensor: ...


class Work(Protocol):
    """What a request holds while it runs: its latents, and its scheduler's step."""

    latents: torch.Tensor

    def scheduler_step(self, noise_pred: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The request's scheduler stepped from `latents` with `noise_pred` at timestep `t`."""
        ...


PlanT = TypeVar("PlanT", bound=Plan)
WorkT = TypeVar("WorkT", bound=Work)


@dataclass
class StepState(Generic[PlanT, WorkT]):
    """A running request: `plan` (read by every step), `work` (None once released)."""

    plan: PlanT
    work: WorkT | None
    step_index: int = 0  # denoise steps done
    request_id: str = ""
    cache: RowCache | None = None  # the row's step cache (None: off); freed on release
    preview: Previewer | None = None  # the request's step previews (None: it asked for none)
    lora: LoraHold | None = None  # its LoRA adapters' slots (None: none); freed on release

    def release(self, step_cache: StepCache, lora_slots: SlotBank | None) -> None:
        """Free what the row holds (its step cache, its adapters' slots, its work): the
        request left the stage."""
        step_cache.free(self.cache)
        self.cache = None
        if lora_slots is not None:
            lora_slots.release(self.lora)
        self.lora = None
        self.work = None

    def live(self) -> WorkT:
        if self.work is None:
            raise RuntimeError("denoise state used after release")
        return self.work

    def timestep(self) -> torch.Tensor:
        """The timestep of the step to do next."""
        return self.plan.timesteps[self.step_index]

    def advance(self, prediction: Prediction) -> StepOutput[Preview]:
        """The scheduler step for this state (its own scheduler copy, its own timestep).

        Runs after the batch's forwards, so a failure here is this state's error output:
        raising would leave its batch mates half advanced."""
        work = self.live()
        try:
            stepped = work.scheduler_step(prediction.noise, self.timestep())
        except Exception as exc:
            logger.exception("scheduler step %d failed", self.step_index)
            return StepOutput(step_index=self.step_index, error=f"scheduler step failed: {exc}")
        preview = (None if self.preview is None
                   else self.preview.after(self.step_index + 1, work.latents, prediction.noise))
        work.latents = stepped
        self.step_index += 1
        return StepOutput(
            step_index=self.step_index,
            finished=self.step_index == len(self.plan.timesteps),
            partial=preview,
            reused=prediction.reused,
        )


@dataclass(frozen=True)
class Prediction:
    """A state's noise prediction for one step (guidance applied)."""

    noise: torch.Tensor
    reused: bool = False  # every branch reused its step cache: no full transformer pass ran


class Advancing(Protocol):
    """A state one step advances: `StepState` of any plan and work."""

    def advance(self, prediction: Prediction) -> StepOutput[Preview]: ...


StateT = TypeVar("StateT", bound=Advancing)


def step_batch(
    states: Sequence[StateT],
    predict: Callable[[Sequence[StateT]], list[Prediction]],
    device: torch.device,
) -> list[StepOutput[Preview]]:
    """One denoising step for every state: `predict` gives each state's noise prediction
    (guidance applied), then each state's scheduler steps; the step ends when the device has
    done it."""
    if not states:
        return []
    predictions = predict(states)
    outputs = [state.advance(pred) for state, pred in zip(states, predictions, strict=True)]
    synchronize(device)
    return outputs


def check_one_batch(
    states: Sequence[StateT], key: Callable[[StateT], tuple[object, ...]], what: str
) -> None:
    """Every state of one step shares `key` (the shapes one forward needs alike)."""
    keys = {key(state) for state in states}
    if len(keys) > 1:
        raise ValueError(f"one step takes states of one {what}, got {sorted(keys)}")


def seeded_noise(
    shape: tuple[int, ...], seed: int, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """A request's starting noise as the stock pipelines draw it with
    `generator=torch.Generator("cpu").manual_seed(seed)`: on the CPU, then moved to `device`,
    so a seed gives the same latents on every device."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    noise: torch.Tensor = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
    return noise
