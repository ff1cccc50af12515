"""DiT stage for Qwen-Image: prompt embeddings -> denoised packed latents, one step per tick.

Loads the `transformer` and `scheduler` components of a diffusers Qwen-Image folder and runs
`QwenImagePipeline.__call__` phases 4-6 (latents, timesteps, denoising loop) as a step machine:
`prepare` seeds the latents and the schedule, each `step` is one iteration of the pipeline's loop
body, and `finish` returns the latents exactly as the pipeline holds them before decoding.

Step batching: one `step` call advances every state it is given with ONE transformer forward.
Its rows are the conditional rows of all states, then the unconditional rows of the states
that run true CFG (so a guided request also halves its forwards). Each row keeps its own
timestep (requests sit at different steps of different schedules), text embeddings (prompts of
different token lengths are right-padded, `encoder_hidden_states_mask` hides the padding) and
scheduler; rows of different image sizes cannot share a forward (diffusers' rotary embedding
takes the first row's image shape for all rows), so the batch key is the image size. A row's
result matches the same request stepped alone within float rounding (< 1e-6 measured).

Mid-step abort: once bound to a `StepInterrupt`, a pre-hook on every transformer block asks it
whether the whole batch has been cancelled and raises `StepInterrupted` there; no state has
been touched before the forward ends, so an interrupted step leaves every state as it was.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import assert_never

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel
from diffusers.pipelines.qwenimage.pipeline_qwenimage import (
    QwenImagePipeline,
    calculate_shift,
    retrieve_timesteps,
)
from diffusers.schedulers.scheduling_flow_match_euler_discrete import (
    FlowMatchEulerDiscreteScheduler,
)
from diffusers.utils.torch_utils import randn_tensor

from stagemesh.models.families.qwen_image import (
    MAX_IMAGE_SIDE,
    PROMPT_MAX_TOKENS,
    PromptEmbeddings,
    latent_factor,
)
from stagemesh.models.options import capped_option
from stagemesh.shared.devices import CPU_FLOAT32, CpuDtype, LaunchPacer, Placement, synchronize
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    NoStream,
    StageAdapter,
    StepOutput,
)
from stagemesh.shared.engine.interrupt import Interruptible, StepInterrupt
from stagemesh.shared.limits import MAX_SEED

logger = logging.getLogger(__name__)

# The model's own caps: no option can raise a limit above these.
MAX_STEPS = 1000
MAX_TRUE_CFG_SCALE = 30.0
#: The stage's default dtype on a CPU (`stagemesh.shared.devices.CpuDtype`), from `stagemesh
#: bench dtypes` (1 thread, 20 rounds interleaved) on 16 steps at 32x32 with true CFG with
#: tiny-shapes' DiT; best float32 / best bfloat16, median per-round bf16 speed-up:
#: Xeon with AMX-BF16 205 / 251 ms, 0.80x (again 215 / 259 ms, 0.77x) -> float32;
#: the same CPU held to AVX2 (no bfloat16 instructions) 126 / 291 ms, 0.43x -> float32.
#: A larger DiT gains on that Xeon: qwen-image-bench (32.5 M parameters) steps at 256x256 in
#: 147 ms in float32 and 87 ms in bfloat16 (1.64x); its recipe may set `dtype: bfloat16`.
CPU_DTYPE = CpuDtype(with_native_bf16=torch.float32)
CPU = torch.device("cpu")


@dataclass(frozen=True)
class DitLimits:
    """What the stage accepts (its Describe facts): options, tightened to the model's caps."""

    size_multiple: int  # height and width are multiples of this (the latent factor)
    max_side: int  # pixels, a multiple of size_multiple
    max_pixels: int  # height x width
    max_steps: int
    max_true_cfg_scale: float
    max_images_per_request: int  # enforced by the caller: each image is its own DiT request
    min_steps: int  # 2 when the scheduler stretches to a terminal shift (see scheduler_min_steps)


@dataclass(frozen=True)
class DenoiseInput:
    """One text-to-image denoise. Guidance runs only with negative embeddings and scale > 1."""

    embeddings: PromptEmbeddings
    height: int
    width: int
    num_inference_steps: int
    true_cfg_scale: float
    seed: int
    sigmas: list[float] | None = None


@dataclass(frozen=True)
class DenoisedLatents:
    """The DiT stage's result: packed latents [1, tokens, z_dim * 4], the pixel size they make."""

    latents: torch.Tensor
    height: int
    width: int


@dataclass(frozen=True)
class _Plan:
    """What a request fixes in `prepare` and every step reads."""

    timesteps: torch.Tensor
    img_shape: tuple[int, int, int]  # (frames, latent rows, latent columns) for the rotary code
    do_true_cfg: bool
    true_cfg_scale: float
    height: int
    width: int


@dataclass
class _Work:
    """What a request holds while it runs; dropped on release."""

    latents: torch.Tensor
    embeddings: PromptEmbeddings
    scheduler: FlowMatchEulerDiscreteScheduler  # a per-request copy: step() mutates it


@dataclass
class DenoiseState:
    plan: _Plan
    work: _Work | None
    step_index: int = 0  # denoise steps done

    def live(self) -> _Work:
        if self.work is None:
            raise RuntimeError("denoise state used after release")
        return self.work


class DenoiseAdapter:
    """The DiT stage's model: QwenImageTransformer2DModel + its FlowMatch scheduler."""

    stage = "dit"

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_steps: int = 200,
        max_pixels: int = 1024 * 1024,
        max_side: int = MAX_IMAGE_SIDE,
        max_true_cfg_scale: float = 20.0,
        max_images_per_request: int = 4,
        placement: Placement = CPU_FLOAT32,
    ) -> None:
        """placement: where the transformer computes, and in what dtype; latents, timesteps and
        embeddings of a request live there, latents leave on the CPU in that dtype."""
        transformer = QwenImageTransformer2DModel.from_pretrained(
            model_dir,
            subfolder="transformer",
            local_files_only=True,
            dtype=placement.dtype,
            device_map=placement.device_name,  # straight onto the device, not via host memory
        )
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(
            model_dir, subfolder="scheduler", local_files_only=True
        )
        factor = latent_factor(model_dir)
        limits = _limits(
            factor,
            min_steps=scheduler_min_steps(scheduler),
            max_steps=max_steps,
            max_pixels=max_pixels,
            max_side=max_side,
            max_true_cfg_scale=max_true_cfg_scale,
            max_images_per_request=max_images_per_request,
        )
        self._setup(transformer, scheduler, factor, limits)

    @classmethod
    def from_components(
        cls,
        transformer: QwenImageTransformer2DModel,
        scheduler: FlowMatchEulerDiscreteScheduler,
        limits: DitLimits,
    ) -> DenoiseAdapter:
        """An adapter over a transformer already built, on its device in its dtype: e.g. a
        real-size one with random weights (`stagemesh bench gpu`), which no folder holds."""
        adapter = cls.__new__(cls)
        adapter._setup(transformer, scheduler, limits.size_multiple, limits)
        return adapter

    def _setup(
        self,
        transformer: QwenImageTransformer2DModel,
        scheduler: FlowMatchEulerDiscreteScheduler,
        factor: int,
        limits: DitLimits,
    ) -> None:
        if transformer.config["guidance_embeds"]:
            raise ValueError("guidance-distilled Qwen-Image transformers are not supported")
        self.transformer = transformer.eval()
        self.scheduler = scheduler
        self.latent_factor = factor
        self.vae_scale_factor = factor // 2
        self.placement = Placement(transformer.device, transformer.dtype)
        self._device = self.placement.device
        self._dtype = self.placement.dtype
        self._text_dim: int = transformer.config["joint_attention_dim"]
        self._interrupt_hooks: list[torch.utils.hooks.RemovableHandle] = []
        # Keeps the interrupt checks between blocks close to what the device is computing.
        self._pacer = LaunchPacer(self._device)
        self.limits = limits

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: DenoiseInput) -> None:
        limits = self.limits
        self._check_size(payload.height, payload.width)
        steps = payload.num_inference_steps
        if not limits.min_steps <= steps <= limits.max_steps:
            raise InvalidInputError(
                "num_inference_steps",
                f"num_inference_steps must be in [{limits.min_steps}, {limits.max_steps}], "
                f"got {steps}",
            )
        if payload.sigmas is not None:
            _check_sigmas(payload.sigmas, steps)
        scale = payload.true_cfg_scale
        if not (math.isfinite(scale) and 0.0 <= scale <= limits.max_true_cfg_scale):
            raise InvalidInputError(
                "true_cfg_scale",
                f"true_cfg_scale must be in [0, {limits.max_true_cfg_scale}], got {scale}",
            )
        if not 0 <= payload.seed <= MAX_SEED:
            raise InvalidInputError("seed", f"seed must be in [0, {MAX_SEED}], got {payload.seed}")
        self._check_embeddings(payload.embeddings)

    def _check_size(self, height: int, width: int) -> None:
        factor, max_side = self.limits.size_multiple, self.limits.max_side
        for side in (height, width):
            if not (0 < side <= max_side and side % factor == 0):
                raise InvalidInputError(
                    "size",
                    f"height and width must be positive multiples of {factor} up to {max_side}, "
                    f"got {height}x{width}",
                )
        if height * width > self.limits.max_pixels:
            raise InvalidInputError(
                "size",
                f"{height}x{width} is more than {self.limits.max_pixels} pixels",
            )

    def _check_embeddings(self, embeddings: PromptEmbeddings) -> None:
        dim = self._text_dim
        _check_embeds("prompt_embeds", embeddings.prompt_embeds, embeddings.prompt_embeds_mask, dim)
        neg, neg_mask = embeddings.negative_prompt_embeds, embeddings.negative_prompt_embeds_mask
        if neg is not None:
            _check_embeds("negative_prompt_embeds", neg, neg_mask, dim)
        elif neg_mask is not None:
            raise InvalidInputError(
                "embeddings", "negative_prompt_embeds_mask given without negative_prompt_embeds"
            )

    # -- step machine -------------------------------------------------------------------------

    @torch.inference_mode()
    def prepare(self, request: EngineRequest[DenoiseInput]) -> DenoiseState:
        payload = request.payload
        # Whatever dtype they came in (another stage's), rows of a forward share the DiT's.
        embeddings = payload.embeddings.to(self._device, self._dtype)
        latents = self.prepare_latents(payload, self._dtype)
        scheduler = copy.deepcopy(self.scheduler)
        timesteps = self.prepare_timesteps(scheduler, payload, image_seq_len=latents.shape[1])
        has_negative = embeddings.negative_prompt_embeds is not None
        patches = (payload.height // self.latent_factor, payload.width // self.latent_factor)
        plan = _Plan(
            timesteps=timesteps,
            img_shape=(1, *patches),
            do_true_cfg=payload.true_cfg_scale > 1 and has_negative,
            true_cfg_scale=payload.true_cfg_scale,
            height=payload.height,
            width=payload.width,
        )
        return DenoiseState(plan=plan, work=_Work(latents, embeddings, scheduler))

    def add_input(self, state: DenoiseState, payload: NoStream) -> None:
        assert_never(payload)  # the DiT stage takes no streamed input

    @torch.inference_mode()
    def step(self, states: Sequence[DenoiseState]) -> list[StepOutput[NoStream]]:
        """One denoising step for every state, all in one transformer forward.

        Nothing is written to a state until the forward and every guidance combination are
        done: a forward that raises (StepInterrupted included) leaves all states as they were,
        so the engine may retry them one by one.
        """
        if not states:
            return []
        self._check_batch(states)
        predictions = self._predict(states)
        outputs = [self._advance(state, pred) for state, pred in zip(states, predictions,
                                                                      strict=True)]
        synchronize(self._device)  # the step ends when the device has done it
        return outputs

    def finish(self, state: DenoiseState) -> DenoisedLatents:
        """The latents, handed over on the CPU (copied off an accelerator here, on the compute
        thread, not where they are sent)."""
        latents = state.live().latents.to(CPU)
        return DenoisedLatents(latents, state.plan.height, state.plan.width)

    def release(self, state: DenoiseState) -> None:
        state.work = None

    def batch_key(self, state: DenoiseState) -> Hashable:
        """The image size: rows of one forward must share it (guided or not does not matter)."""
        return (state.plan.height, state.plan.width)

    # -- mid-step abort -----------------------------------------------------------------------

    def bind_interrupt(self, interrupt: StepInterrupt) -> None:
        """Check `interrupt` before every transformer block (replaces an earlier binding)."""
        for handle in self._interrupt_hooks:
            handle.remove()

        def check(module: torch.nn.Module, args: tuple[object, ...]) -> None:
            self._pacer.mark()
            interrupt.check()

        self._interrupt_hooks = [
            block.register_forward_pre_hook(check) for block in self.transformer.transformer_blocks
        ]

    # -- phases (QwenImagePipeline.__call__ steps 4-6) ----------------------------------------

    def prepare_latents(self, payload: DenoiseInput, dtype: torch.dtype) -> torch.Tensor:
        """Seeded noise, packed into 2x2 patches (the pipeline's prepare_latents)."""
        channels = self.transformer.config["in_channels"] // 4
        height = payload.height // self.vae_scale_factor
        width = payload.width // self.vae_scale_factor
        generator = torch.Generator(device="cpu").manual_seed(payload.seed)
        noise: torch.Tensor = randn_tensor(
            (1, 1, channels, height, width), generator=generator, device=self._device, dtype=dtype
        )
        packed: torch.Tensor = QwenImagePipeline._pack_latents(noise, 1, channels, height, width)
        return packed

    def prepare_timesteps(
        self, scheduler: FlowMatchEulerDiscreteScheduler, payload: DenoiseInput, image_seq_len: int
    ) -> torch.Tensor:
        """Resolution-shifted sigmas set on `scheduler` (the pipeline's step 5)."""
        steps = payload.num_inference_steps
        sigmas: list[float] = (
            np.linspace(1.0, 1 / steps, steps).tolist()
            if payload.sigmas is None
            else payload.sigmas
        )
        config = scheduler.config
        mu = calculate_shift(
            image_seq_len,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        timesteps: torch.Tensor
        timesteps, _ = retrieve_timesteps(scheduler, steps, self._device, sigmas=sigmas, mu=mu)
        scheduler.set_begin_index(0)
        return timesteps

    @staticmethod
    def _check_batch(states: Sequence[DenoiseState]) -> None:
        sizes = {(state.plan.height, state.plan.width) for state in states}
        if len(sizes) > 1:
            raise ValueError(f"one step takes states of one image size, got {sorted(sizes)}")

    def _predict(self, states: Sequence[DenoiseState]) -> list[torch.Tensor]:
        """Each state's noise prediction (true CFG applied), from one transformer forward."""
        guided = [state for state in states if state.plan.do_true_cfg]
        rows = [_row(state, negative=False) for state in states]
        rows += [_row(state, negative=True) for state in guided]
        output = self._forward(rows)
        predictions = [output[i : i + 1] for i in range(len(states))]
        unconditional = iter(range(len(states), len(rows)))
        for i, state in enumerate(states):
            if state.plan.do_true_cfg:
                row = next(unconditional)
                uncond = output[row : row + 1]
                predictions[i] = _true_cfg(predictions[i], uncond, state.plan.true_cfg_scale)
        return predictions

    def _forward(self, rows: Sequence[_Row]) -> torch.Tensor:
        """One transformer forward over `rows` (all of one image size): [rows, tokens, C]."""
        latents = torch.cat([row.latents for row in rows])
        timestep = torch.stack([row.timestep for row in rows]).to(latents.dtype)
        self._pacer.reset()
        embeds, mask = _padded_text(rows, self._device)
        prediction: torch.Tensor = self.transformer(
            hidden_states=latents,
            timestep=timestep / 1000,
            guidance=None,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=embeds,
            img_shapes=[[rows[0].img_shape]] * len(rows),
            return_dict=False,
        )[0]
        return prediction

    def _advance(self, state: DenoiseState, noise_pred: torch.Tensor) -> StepOutput[NoStream]:
        """The scheduler step for one state (its own scheduler copy, its own timestep).

        Runs after the shared forward, so a failure here is this state's error output: raising
        would leave its batch mates half advanced."""
        work, plan = state.live(), state.plan
        t = plan.timesteps[state.step_index]
        try:
            # diffusers annotates the legacy torch.FloatTensor; any float tensor is what it takes.
            stepped: torch.Tensor = work.scheduler.step(
                noise_pred,  # type: ignore[arg-type]
                t,  # type: ignore[arg-type]
                work.latents,  # type: ignore[arg-type]
                return_dict=False,
            )[0]
        except Exception as exc:
            logger.exception("scheduler step %d failed", state.step_index)
            return StepOutput(step_index=state.step_index, error=f"scheduler step failed: {exc}")
        work.latents = stepped
        state.step_index += 1
        return StepOutput(
            step_index=state.step_index, finished=state.step_index == len(plan.timesteps)
        )


@dataclass(frozen=True)
class _Row:
    """One row of a batched forward: a state's latents under one of its prompts."""

    latents: torch.Tensor  # [1, tokens, C]
    timestep: torch.Tensor  # scalar: the state's current timestep
    embeds: torch.Tensor  # [1, seq, hidden]
    mask: torch.Tensor | None  # [1, seq]; None = every token is valid
    img_shape: tuple[int, int, int]


def _row(state: DenoiseState, *, negative: bool) -> _Row:
    """A state's conditional row, or (negative=True) its unconditional row for true CFG."""
    work, plan = state.live(), state.plan
    emb = work.embeddings
    embeds, mask = (
        (emb.negative_prompt_embeds, emb.negative_prompt_embeds_mask)
        if negative
        else (emb.prompt_embeds, emb.prompt_embeds_mask)
    )
    if embeds is None:
        raise RuntimeError("true CFG planned without negative embeddings")
    return _Row(work.latents, plan.timesteps[state.step_index], embeds, mask, plan.img_shape)


def _padded_text(
    rows: Sequence[_Row], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows' text embeddings right-padded to the longest, and the mask that hides the
    padding. The mask is None when no row needs one, exactly as the pipeline passes it."""
    lengths = [row.embeds.shape[1] for row in rows]
    longest = max(lengths)
    if all(row.mask is None for row in rows) and min(lengths) == longest:
        return torch.cat([row.embeds for row in rows]), None
    embeds = torch.cat(
        [
            F.pad(row.embeds, (0, 0, 0, longest - length))
            for row, length in zip(rows, lengths, strict=True)
        ]
    )
    mask = torch.zeros(len(rows), longest, dtype=torch.bool, device=device)
    for i, (row, length) in enumerate(zip(rows, lengths, strict=True)):
        mask[i, :length] = True if row.mask is None else row.mask[0].to(torch.bool)
    return embeds, mask


def _true_cfg(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
    """Qwen-Image's true CFG: combine, then rescale to the conditional prediction's norm."""
    combined = uncond + scale * (cond - uncond)
    cond_norm: torch.Tensor = torch.norm(cond, dim=-1, keepdim=True)
    combined_norm: torch.Tensor = torch.norm(combined, dim=-1, keepdim=True)
    return combined * (cond_norm / combined_norm)


def _check_sigmas(sigmas: list[float], steps: int) -> None:
    if len(sigmas) != steps:
        raise InvalidInputError(
            "sigmas", f"sigmas must have num_inference_steps={steps} values, got {len(sigmas)}"
        )
    if not all(math.isfinite(s) and 0.0 < s <= 1.0 for s in sigmas):
        raise InvalidInputError("sigmas", "every sigma must be in (0, 1]")


def scheduler_min_steps(scheduler: FlowMatchEulerDiscreteScheduler) -> int:
    """A schedule stretched to a terminal shift divides by (1 - its last timestep) / (1 -
    shift_terminal): with one step that is 0 / x and the latents become NaN (stock diffusers
    too), so such a model needs two steps at least."""
    return 2 if scheduler.config.get("shift_terminal") else 1


def _limits(
    factor: int,
    *,
    min_steps: int,
    max_steps: int,
    max_pixels: int,
    max_side: int,
    max_true_cfg_scale: float,
    max_images_per_request: int,
) -> DitLimits:
    """The operator's options, tightened to the model's caps; sides round down to a multiple
    of the latent factor (a side that no size can reach would be a false promise)."""
    side = capped_option("max_side", max_side, MAX_IMAGE_SIDE) // factor * factor
    if side < factor:
        raise ValueError(f"option max_side={max_side} is below the model's size multiple {factor}")
    return DitLimits(
        size_multiple=factor,
        max_side=side,
        max_pixels=capped_option("max_pixels", max_pixels, side * side),
        max_steps=capped_option("max_steps", max_steps, MAX_STEPS),
        max_true_cfg_scale=capped_option(
            "max_true_cfg_scale", float(max_true_cfg_scale), MAX_TRUE_CFG_SCALE
        ),
        max_images_per_request=capped_option("max_images_per_request", max_images_per_request),
        min_steps=min_steps,
    )


def _check_embeds(name: str, embeds: torch.Tensor, mask: torch.Tensor | None, dim: int) -> None:
    shape = tuple(embeds.shape)
    limit = PROMPT_MAX_TOKENS
    if embeds.ndim != 3 or shape[0] != 1 or shape[2] != dim or not 1 <= shape[1] <= limit:
        raise InvalidInputError(
            "embeddings", f"{name} must be [1, 1..{limit}, {dim}], got {list(shape)}"
        )
    if not embeds.is_floating_point() or not bool(torch.isfinite(embeds).all()):
        raise InvalidInputError("embeddings", f"{name} must be finite floating-point values")
    if mask is not None and tuple(mask.shape) != shape[:2]:
        raise InvalidInputError(
            "embeddings", f"{name} mask must be {list(shape[:2])}, got {list(mask.shape)}"
        )


#: The static proof that the adapter is the DiT stage's StageAdapter.
_: type[StageAdapter[DenoiseInput, NoStream, DenoiseState, NoStream, DenoisedLatents]] = (
    DenoiseAdapter
)
_interruptible: type[Interruptible] = DenoiseAdapter
