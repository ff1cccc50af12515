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

Image edit (a `QwenImageEditPipeline` folder, told by its model_index.json): a request carries
one condition image, the normalized latents [1, C, 1, h, w] of the VAE stage's EncodeImage.
`prepare` packs them as the edit pipeline's `prepare_latents` does; every forward appends them
to each row's noisy tokens (`hidden_states = cat([latents, image_latents])`, `img_shapes` lists
the output and the condition image) and keeps only the output tokens of the prediction. The
schedule's shift still follows the OUTPUT token count, as in the pipeline. Rows batch only when
their condition shapes match too (the rotary embedding again takes the first row's shapes).

Mid-step abort: `BlockInterruptHooks` on the transformer's blocks (no state has been touched
before the forward ends, so an interrupted step leaves every state as it was).

The forward is our own block loop (`services/dit/forward.py`, bit for bit the transformer's);
each row may carry a step cache (`services/dit/step_cache.py`).
"""

from __future__ import annotations

import copy
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

from stagemesh.models.families.qwen_image import (
    EDIT_IMAGE_AREA,
    MAX_IMAGE_SIDE,
    PROMPT_MAX_TOKENS,
    PromptEmbeddings,
    condition_area,
    latent_factor,
)
from stagemesh.services.dit import checks
from stagemesh.services.dit.forward import Branch, RowHooks, RowMeta, qwen_image_forward
from stagemesh.services.dit.interrupt_hooks import BlockInterruptHooks

# The limits live in services/dit/limits.py (every DiT adapter's); re-exported here, where the
# Qwen-Image stage's users (bench/gpu.py, tests) have always read them.
from stagemesh.services.dit.limits import MAX_STEPS as MAX_STEPS
from stagemesh.services.dit.limits import MAX_TRUE_CFG_SCALE as MAX_TRUE_CFG_SCALE
from stagemesh.services.dit.limits import DitLimits as DitLimits
from stagemesh.services.dit.limits import image_limits
from stagemesh.services.dit.limits import scheduler_min_steps as scheduler_min_steps
from stagemesh.services.dit.lora import LoraCatalog, LoraConfig, LoraUse
from stagemesh.services.dit.lora_slots import SlotBank
from stagemesh.services.dit.parallel import GroupForward, check_tokens
from stagemesh.services.dit.preview import (
    Painter,
    Preview,
    Previewer,
    PreviewOptions,
    check_options,
    preview_histogram,
)
from stagemesh.services.dit.preview_decode import PainterChoice, load_painter
from stagemesh.services.dit.step_cache import StepCache, StepCacheConfig, forward_rows
from stagemesh.services.dit.stepping import (
    Prediction,
    StepState,
    check_one_batch,
    seeded_noise,
    step_batch,
)
from stagemesh.services.dit.types import CPU, DenoisedLatents
from stagemesh.services.folders import folder_class
from stagemesh.shared.devices import CPU_FLOAT32, CpuDtype, LaunchPacer, Placement
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    NoStream,
    StageAdapter,
    StepOutput,
)
from stagemesh.shared.engine.interrupt import Interruptible, StepInterrupt

#: model_index.json `_class_name` of an image-edit folder: its DiT takes one condition image.
EDIT_PIPELINE_CLASS = "QwenImageEditPipeline"
#: Pixels per vision token of Qwen2.5-VL (14 px patches merged 2x2): an edit prompt's embeddings
#: hold the input image's vision tokens as well as the text's (the edit pipeline truncates none).
VISION_TOKEN_SIDE = 28
#: The stage's default dtype on a CPU (`stagemesh.shared.devices.CpuDtype`), from `stagemesh
#: bench dtypes` (1 thread, 20 rounds interleaved) on 16 steps at 32x32 with true CFG with
#: tiny-shapes' DiT; best float32 / best bfloat16, median per-round bf16 speed-up:
#: Xeon with AMX-BF16 205 / 251 ms, 0.80x (again 215 / 259 ms, 0.77x) -> float32;
#: the same CPU held to AVX2 (no bfloat16 instructions) 126 / 291 ms, 0.43x -> float32.
#: A larger DiT gains on that Xeon: qwen-image-bench (32.5 M parameters) steps at 256x256 in
#: 147 ms in float32 and 87 ms in bfloat16 (1.64x); its recipe may set `dtype: bfloat16`.
CPU_DTYPE = CpuDtype(with_native_bf16=torch.float32)


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
    #: Image edit: the input image's normalized latents [1, C, 1, h, w] (VAE EncodeImage);
    #: exactly `DitLimits.max_condition_images` of them (none for a text-to-image model).
    condition_latents: tuple[torch.Tensor, ...] = ()
    #: The request's step cache: None = the stage's setting, 0 = off.
    step_cache_threshold: float | None = None
    #: Step previews (None: none).
    preview: PreviewOptions | None = None
    #: The request's LoRA adapters and scales (names from the stage's `lora_dir`).
    lora: tuple[LoraUse, ...] = ()


@dataclass(frozen=True)
class _Plan:
    """What a request fixes in `prepare` and every step reads."""

    timesteps: torch.Tensor
    #: (frames, patch rows, patch columns) of the output, then of each condition image: the
    #: rotary code's `img_shapes` entry, and (all of it) the batch key.
    img_shapes: tuple[tuple[int, int, int], ...]
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
    condition: torch.Tensor | None = None  # packed condition tokens [1, tokens, C * 4]

    def scheduler_step(self, noise_pred: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        # diffusers annotates the legacy torch.FloatTensor; any float tensor is what it takes.
        stepped: torch.Tensor = self.scheduler.step(
            noise_pred,  # type: ignore[arg-type]
            t,  # type: ignore[arg-type]
            self.latents,  # type: ignore[arg-type]
            return_dict=False,
        )[0]
        return stepped


class DenoiseState(StepState[_Plan, _Work]):
    """A text-to-image or edit request while it runs (`StepState`)."""


class DenoiseAdapter:
    """The DiT stage's model: QwenImageTransformer2DModel + its FlowMatch scheduler."""

    stage = "dit"
    #: How the folder's latents become previews (`load_painter`): None = no step previews.
    painter: Painter | None

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_steps: int = 200,
        max_pixels: int | None = None,
        max_side: int = MAX_IMAGE_SIDE,
        max_true_cfg_scale: float = 20.0,
        max_images_per_request: int = 4,
        placement: Placement = CPU_FLOAT32,
        step_cache: StepCacheConfig | None = None,
        lora: LoraConfig | None = None,
        preview_painter: PainterChoice = PainterChoice.PROJECTION,
    ) -> None:
        """placement: where the transformer computes, and in what dtype; latents, timesteps and
        embeddings of a request live there, latents leave on the CPU in that dtype.
        max_pixels: None = DEFAULT_MAX_PIXELS, or for an edit model every size its pipeline's
        default-size rule makes within max_side (`edit_pixels_bound`).
        step_cache: the stage's step cache (None: off). lora: its adapters (None: off).
        preview_painter: what paints step previews (`load_painter`)."""
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
        edit = is_edit_folder(model_dir)
        limits = image_limits(
            factor,
            edit=edit,
            condition_area=condition_area(model_dir) if edit else EDIT_IMAGE_AREA,
            min_steps=scheduler_min_steps(scheduler),
            max_steps=max_steps,
            max_pixels=max_pixels,
            max_side=max_side,
            max_true_cfg_scale=max_true_cfg_scale,
            max_images_per_request=max_images_per_request,
        )
        self._setup(transformer, scheduler, factor, limits, step_cache, lora)
        self.painter = load_painter(model_dir, self._device, preview_painter)

    @classmethod
    def from_components(
        cls,
        transformer: QwenImageTransformer2DModel,
        scheduler: FlowMatchEulerDiscreteScheduler,
        limits: DitLimits,
        step_cache: StepCacheConfig | None = None,
        lora: LoraConfig | None = None,
    ) -> DenoiseAdapter:
        """An adapter over a transformer already built, on its device in its dtype: e.g. a
        real-size one with random weights (`stagemesh bench gpu`), which no folder holds."""
        adapter = cls.__new__(cls)
        adapter._setup(transformer, scheduler, limits.size_multiple, limits, step_cache, lora)
        return adapter

    def _setup(
        self,
        transformer: QwenImageTransformer2DModel,
        scheduler: FlowMatchEulerDiscreteScheduler,
        factor: int,
        limits: DitLimits,
        step_cache: StepCacheConfig | None,
        lora: LoraConfig | None,
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
        self._latent_channels: int = transformer.config["in_channels"] // 4
        self._max_text_tokens = PROMPT_MAX_TOKENS + (
            _vision_tokens_bound(limits.max_pixels, limits.max_side)
            if limits.max_condition_images
            else 0
        )
        # Keeps the interrupt checks between blocks close to what the device is computing.
        self._pacer = LaunchPacer(self._device)
        self._hooks = BlockInterruptHooks(self._pacer)
        self.limits = limits
        self.step_cache = StepCache(step_cache or StepCacheConfig())
        self.painter = None  # a folder's is loaded after setup
        self.loras = LoraCatalog(lora or LoraConfig())
        self.lora_slots = SlotBank([transformer], self.loras) if self.loras.config.enabled else None
        #: The parallel group this rank 0 runs its forwards over (services/dit/parallel.py).
        self.group: GroupForward | None = None

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: DenoiseInput) -> None:
        limits = self.limits
        checks.check_size(limits, payload.height, payload.width)
        steps = payload.num_inference_steps
        checks.check_steps(limits, steps)
        if payload.sigmas is not None:
            _check_sigmas(payload.sigmas, steps)
        checks.check_scale("true_cfg_scale", payload.true_cfg_scale, limits.max_true_cfg_scale)
        checks.check_seed(payload.seed)
        self._check_embeddings(payload.embeddings)
        self._check_conditions(payload.condition_latents)
        self.step_cache.config.request_threshold(payload.step_cache_threshold)
        check_options(payload.preview, self.painter)
        self.loras.check(payload.lora)
        if self.group is not None:
            tokens = payload.height * payload.width // self.latent_factor**2
            conditions = sum(c.shape[3] * c.shape[4] // 4 for c in payload.condition_latents)
            check_tokens(self.group.degrees, tokens + conditions)

    def _check_embeddings(self, embeddings: PromptEmbeddings) -> None:
        dim, most = self._text_dim, self._max_text_tokens
        checks.check_embeds(
            "prompt_embeds", embeddings.prompt_embeds, embeddings.prompt_embeds_mask, dim, most
        )
        neg, neg_mask = embeddings.negative_prompt_embeds, embeddings.negative_prompt_embeds_mask
        if neg is not None:
            checks.check_embeds("negative_prompt_embeds", neg, neg_mask, dim, most)
        elif neg_mask is not None:
            raise InvalidInputError(
                "embeddings", "negative_prompt_embeds_mask given without negative_prompt_embeds"
            )

    def _check_conditions(self, conditions: Sequence[torch.Tensor]) -> None:
        """An edit model takes exactly its count of condition images, a text-to-image model
        none; each is [1, C, 1, h, w] of the DiT's latent channels, within the size limits."""
        want, task = self.limits.max_condition_images, self.limits.task
        if len(conditions) != want:
            raise InvalidInputError(
                "condition_latents",
                f"a {task} model takes {want} condition_latents, got {len(conditions)}",
            )
        scale = self.vae_scale_factor
        for condition in conditions:
            shape = tuple(condition.shape)
            channels = self._latent_channels
            if len(shape) != 5 or shape[:3] != (1, channels, 1) or shape[3] % 2 or shape[4] % 2:
                raise InvalidInputError(
                    "condition_latents",
                    f"condition_latents must be [1, {channels}, 1, h, w] with even h and w, "
                    f"got {list(shape)}",
                )
            checks.check_finite("condition_latents", "condition_latents", condition)
            checks.check_size(
                self.limits,
                shape[3] * scale,
                shape[4] * scale,
                field="condition_latents",
                what="the condition image (condition_latents x VAE factor): ",
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
        conditions = [self.pack_condition(image) for image in payload.condition_latents]
        plan = _Plan(
            timesteps=timesteps,
            img_shapes=((1, *patches), *(shape for _, shape in conditions)),
            do_true_cfg=payload.true_cfg_scale > 1 and has_negative,
            true_cfg_scale=payload.true_cfg_scale,
            height=payload.height,
            width=payload.width,
        )
        condition = torch.cat([packed for packed, _ in conditions], dim=1) if conditions else None
        threshold = self.step_cache.config.request_threshold(payload.step_cache_threshold)
        lora = self.lora_slots.hold(payload.lora) if self.lora_slots else None
        return DenoiseState(
            plan=plan,
            work=_Work(latents, embeddings, scheduler, condition),
            request_id=request.request_id,
            cache=self.step_cache.new_row(threshold),
            preview=self._previewer(payload, scheduler),
            lora=lora,
        )

    def _previewer(self, payload: DenoiseInput,
                   scheduler: FlowMatchEulerDiscreteScheduler) -> Previewer | None:
        if payload.preview is None or self.painter is None:
            return None

        def grid(latents: torch.Tensor) -> torch.Tensor:  # packed 2x2 patches -> [C, h, w]
            unpacked: torch.Tensor = QwenImagePipeline._unpack_latents(
                latents, payload.height, payload.width, self.vae_scale_factor)
            return unpacked[0, :, 0]

        return Previewer(payload.preview, self.painter, scheduler.sigmas, grid,
                         preview_histogram())

    def add_input(self, state: DenoiseState, payload: NoStream) -> None:
        assert_never(payload)  # the DiT stage takes no streamed input

    @torch.inference_mode()
    def step(self, states: Sequence[DenoiseState]) -> list[StepOutput[Preview]]:
        """One denoising step for every state, all in one transformer forward.

        Nothing is written to a state until the forward and every guidance combination are
        done: a forward that raises (StepInterrupted included) leaves all states as they were,
        so the engine may retry them one by one.
        """
        check_one_batch(states, _image_shapes, "image size")
        if self.lora_slots is not None:  # states whose adapters are not attached yet wait
            return self.lora_slots.step_attached(states, self._step)
        return self._step(states)

    def _step(self, states: Sequence[DenoiseState]) -> list[StepOutput[Preview]]:
        return step_batch(states, self._predict, self._device)

    def finish(self, state: DenoiseState) -> DenoisedLatents:
        """The latents, handed over on the CPU (copied off an accelerator here, on the compute
        thread, not where they are sent)."""
        latents = state.live().latents.to(CPU)
        return DenoisedLatents(latents, state.plan.height, state.plan.width)

    def release(self, state: DenoiseState) -> None:
        state.release(self.step_cache, self.lora_slots)

    def batch_key(self, state: DenoiseState) -> Hashable:
        """The image size, and each condition image's: rows of one forward must share them
        (guided or not does not matter)."""
        return (state.plan.height, state.plan.width, *state.plan.img_shapes[1:])

    def step_cache_bytes_per_row(self) -> int:
        """What one guided request's step cache holds at most: at max_pixels, with as many
        condition images of that size as the model takes."""
        limits, config = self.limits, self.transformer.config
        out_tokens = limits.max_pixels // self.latent_factor**2
        tokens = out_tokens * (1 + limits.max_condition_images)
        hidden = config["num_attention_heads"] * config["attention_head_dim"]
        itemsize = self._dtype.itemsize
        return self.step_cache.config.bytes_per_row(
            tokens, hidden, out_tokens * config["in_channels"], itemsize
        )

    # -- mid-step abort -----------------------------------------------------------------------

    def bind_interrupt(self, interrupt: StepInterrupt) -> None:
        """Check `interrupt` before every transformer block (replaces an earlier binding); in
        a group, every rank votes on it there."""
        if self.group is not None:
            self.group.bind_interrupt(interrupt)
            return
        self._hooks.bind(interrupt, self.transformer.transformer_blocks)

    # -- phases (QwenImagePipeline.__call__ steps 4-6) ----------------------------------------

    def prepare_latents(self, payload: DenoiseInput, dtype: torch.dtype) -> torch.Tensor:
        """Seeded noise, packed into 2x2 patches (the pipeline's prepare_latents)."""
        channels = self.transformer.config["in_channels"] // 4
        height = payload.height // self.vae_scale_factor
        width = payload.width // self.vae_scale_factor
        noise = seeded_noise((1, 1, channels, height, width), payload.seed, self._device, dtype)
        packed: torch.Tensor = QwenImagePipeline._pack_latents(noise, 1, channels, height, width)
        return packed

    def pack_condition(
        self, condition: torch.Tensor
    ) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """A condition image's latents [1, C, 1, h, w] packed into 2x2 patches as the edit
        pipeline's prepare_latents does, in the DiT's dtype, and its rotary shape."""
        _, channels, _, height, width = condition.shape
        latents = condition.to(device=self._device, dtype=self._dtype)
        packed: torch.Tensor = QwenImagePipeline._pack_latents(
            latents, 1, channels, height, width
        )
        return packed, (1, height // 2, width // 2)

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

    def _predict(self, states: Sequence[DenoiseState]) -> list[Prediction]:
        """Each state's noise prediction (true CFG applied), from one transformer forward over
        the rows that compute (the step cache may forecast or reuse the others); the rows'
        caches take this step's entries once every prediction is made."""
        guided = [state for state in states if state.plan.do_true_cfg]
        rows = [_row(state, negative=False) for state in states]
        rows += [_row(state, negative=True) for state in guided]
        cache = self.step_cache.begin()
        slots = [
            cache.slot(owner.cache, row.meta.branch, owner.step_index, len(owner.plan.timesteps))
            for owner, row in zip([*states, *guided], rows, strict=True)
        ]
        output = forward_rows(
            cache, slots, lambda run, hooks: self._forward([rows[i] for i in run], hooks)
        )
        predictions = [Prediction(output[i], slots[i].reused) for i in range(len(states))]
        unconditional = iter(range(len(states), len(rows)))
        for i, state in enumerate(states):
            if state.plan.do_true_cfg:
                row = next(unconditional)
                noise = _true_cfg(output[i], output[row], state.plan.true_cfg_scale)
                predictions[i] = Prediction(noise, slots[i].reused and slots[row].reused)
        cache.commit()
        return predictions

    def _forward(self, rows: Sequence[_Row], hooks: RowHooks | None = None) -> torch.Tensor:
        """One transformer forward over `rows` (all of one image size, and one condition size):
        [rows, tokens, C], the output tokens only (condition tokens are input alone)."""
        tokens = rows[0].latents.shape[1]
        latents = torch.cat([row.model_input() for row in rows])
        timestep = torch.stack([row.timestep for row in rows]).to(latents.dtype)
        self._pacer.reset()
        embeds, mask = _padded_text(rows, self._device)
        forward = qwen_image_forward if self.group is None else self.group.qwen_image
        prediction = forward(
            self.transformer,
            hidden_states=latents,
            timestep=timestep / 1000,
            encoder_hidden_states_mask=mask,
            encoder_hidden_states=embeds,
            img_shapes=[list(rows[0].img_shapes)] * len(rows),
            rows=[row.meta for row in rows],
            hooks=hooks,
            adapters=self.lora_slots,
        )
        return prediction[:, :tokens]


@dataclass(frozen=True)
class _Row:
    """One row of a batched forward: a state's latents under one of its prompts."""

    latents: torch.Tensor  # [1, tokens, C]
    timestep: torch.Tensor  # scalar: the state's current timestep
    embeds: torch.Tensor  # [1, seq, hidden]
    mask: torch.Tensor | None  # [1, seq]; None = every token is valid
    img_shapes: tuple[tuple[int, int, int], ...]
    condition: torch.Tensor | None  # packed condition tokens, appended after the latents
    meta: RowMeta

    def model_input(self) -> torch.Tensor:
        """The transformer's hidden_states for this row: the noisy tokens, then (image edit)
        the condition image's, as the edit pipeline's `cat([latents, image_latents], dim=1)`."""
        if self.condition is None:
            return self.latents
        return torch.cat([self.latents, self.condition], dim=1)


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
    return _Row(
        work.latents,
        state.timestep(),
        embeds,
        mask,
        plan.img_shapes,
        work.condition,
        RowMeta(
            state.request_id,
            Branch.UNCOND if negative else Branch.COND,
            state.lora.slots or () if state.lora else (),
        ),
    )


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


def _image_shapes(state: DenoiseState) -> tuple[tuple[int, int, int], ...]:
    """The output's and the condition images' rotary shapes: one forward's rows share them."""
    return state.plan.img_shapes


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


def is_edit_folder(model_dir: str | Path) -> bool:
    """Whether the folder is a Qwen-Image-Edit pipeline (its DiT takes a condition image)."""
    return folder_class(model_dir) == EDIT_PIPELINE_CLASS


def _vision_tokens_bound(max_pixels: int, max_side: int) -> int:
    """The most vision tokens an edit prompt's input image may add to its embeddings when the
    image is within the condition limits: Qwen2-VL rounds each side to a multiple of 28 (at
    most 14 px more per side) and makes one token per 28x28; its smallest image is 2x2 tokens."""
    half = VISION_TOKEN_SIDE // 2
    rounded_up = max_pixels + half * 2 * max_side + half * half
    return -(-rounded_up // VISION_TOKEN_SIDE**2) + 4


#: The static proof that the adapter is the DiT stage's StageAdapter.
_: type[StageAdapter[DenoiseInput, NoStream, DenoiseState, Preview, DenoisedLatents]] = (
    DenoiseAdapter
)
_interruptible: type[Interruptible] = DenoiseAdapter
