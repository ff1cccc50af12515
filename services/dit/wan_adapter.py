"""DiT stage for Wan video models: prompt embeddings (+ an image's latents) -> video latents.

Serves the folders of diffusers' `WanPipeline` (text-to-video, Wan 2.1 style: one
`WanTransformer3DModel`) and `WanImageToVideoPipeline` without an image encoder (Wan 2.2 A14B
style: `transformer` for the high-noise steps, `transformer_2` for the rest, split at
`boundary_ratio * num_train_timesteps`). It runs the pipelines' phases 4-6 (timesteps, latents,
denoising loop) as a step machine, exactly as `__call__` does for one prompt and one video:

- `prepare`: the request's OWN `UniPCMultistepScheduler` (the multistep solver keeps the last
  predictions, so a shared one would mix requests; built from the folder's config with the
  request's `flow_shift` if it sets one, the way a user swaps `pipe.scheduler`), its
  timesteps, the seeded noise [1, z, F_lat, h, w] in float32 drawn on the CPU as
  `prepare_latents` draws it, and for image-to-video the condition: the first-frame mask the
  pipeline builds from `num_frames`, then the image's normalized latents from the VAE stage's
  EncodeImage (the DiT builds the mask; the VAE stage knows nothing of it).
- `step`: one loop body: the transformer of this timestep (with its guidance scale), the
  conditional and (guidance_scale > 1) unconditional predictions, CFG, one scheduler step.
- `finish`: the latents as `__call__(output_type="latent")` returns them.

Batching (correctness first): the batch key is the video shape (frames, height, width), so
states of one shape share a `step` call; inside it, rows that run the same transformer with
text embeddings of the same length share one forward (Wan attends to every text token, so
rows of different lengths cannot be padded into one), each row with its own timestep. A row's
result matches the request stepped alone within float rounding.

Mid-step abort: `BlockInterruptHooks` on the blocks of both transformers.

The forward is our own block loop (`services/dit/forward.py`); each row may carry a step cache
(`services/dit/step_cache.py`), started anew when a Wan 2.2 row switches transformer.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from math import prod
from pathlib import Path
from typing import assert_never

import torch
from diffusers.loaders.lora_pipeline import WanLoraLoaderMixin
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
from diffusers.schedulers.scheduling_unipc_multistep import UniPCMultistepScheduler

from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.models.families.wan import (
    PROMPT_MAX_TOKENS,
    SECOND_TRANSFORMER,
    WanGeometry,
    boundary_timestep,
    i2v_condition_mask,
    read_boundary_ratio,
)
from stagemesh.models.options import capped_option
from stagemesh.services.dit import checks
from stagemesh.services.dit.forward import Branch, RowHooks, RowMeta, wan_forward
from stagemesh.services.dit.interrupt_hooks import BlockInterruptHooks
from stagemesh.services.dit.limits import DitLimits, image_limits, scheduler_min_steps
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
from stagemesh.services.registry import WAN, classes_of
from stagemesh.shared.devices import CPU_FLOAT32, LaunchPacer, Placement
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    NoStream,
    StageAdapter,
    StepOutput,
)
from stagemesh.shared.engine.interrupt import Interruptible, StepInterrupt
from stagemesh.shared.limits import MAX_FLOW_SHIFT

logger = logging.getLogger(__name__)

#: model_index.json `_class_name` -> the task the folder serves (DescribeDitResponse.task).
WAN_TASKS = {name: family.task for name, family in classes_of(WAN).items()}
#: Frames unless the recipe sets `max_frames` (Wan's default clip: 81 frames, 5 s at 16 fps).
DEFAULT_MAX_FRAMES = 81
#: frames x height x width unless the recipe sets `max_video_pixels` (or max_frames x max_pixels
#: if less): 81 frames of 1280x720.
DEFAULT_MAX_VIDEO_PIXELS = 81 * 1280 * 720


@dataclass(frozen=True)
class WanFolder:
    """What a Wan pipeline folder fixes besides its weights: the task (model_index.json), the
    geometry (`WanGeometry`, the family's one reading of the configs), the transformers used."""

    task: str  # "text-to-video" or "image-to-video"
    geometry: WanGeometry
    boundary_ratio: float | None  # None: one transformer for every step
    has_second_transformer: bool  # transformer_2 present and used (boundary_ratio set)

    @classmethod
    def read(cls, model_dir: str | Path) -> WanFolder:
        root = Path(model_dir)
        index = json.loads((root / "model_index.json").read_text())
        task = WAN_TASKS.get(folder_class(root) or "")
        if task is None:
            raise ValueError(f"{root}: not a Wan pipeline folder ({sorted(WAN_TASKS)})")
        if index.get("expand_timesteps"):
            raise ValueError(f"{root}: expand_timesteps (Wan 2.2 TI2V) is not supported")
        if _component(index, "image_encoder"):
            raise ValueError(f"{root}: Wan 2.1 image encoders (CLIP) are not supported")
        if not _component(index, "transformer"):
            raise ValueError(f"{root}: a Wan folder without `transformer` is not supported")
        boundary = read_boundary_ratio(root)
        if _component(index, SECOND_TRANSFORMER) and boundary is None:
            logger.warning("%s: transformer_2 without boundary_ratio is never used", root)
        return cls(
            task=task,
            geometry=WanGeometry.from_folder(root),
            boundary_ratio=boundary,
            has_second_transformer=_component(index, SECOND_TRANSFORMER) and boundary is not None,
        )

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, ...]:
        """[1, z, F_lat, h, w]: the noise, the condition image's latents and the result."""
        return (1, *self.geometry.latent_shape(num_frames, height, width))


def _component(index: dict[str, object], name: str) -> bool:
    """Whether model_index.json lists `name` as a present component (not [null, null])."""
    entry = index.get(name)
    return isinstance(entry, list) and any(part is not None for part in entry)


@dataclass(frozen=True)
class VideoDenoiseInput:
    """One video denoise, as `WanPipeline.__call__` / `WanImageToVideoPipeline.__call__` take it.

    guidance_scale: CFG runs when it is > 1 (then negative embeddings are required), as in the
    pipelines; guidance_scale_2 (default guidance_scale) applies after the boundary of a
    two-transformer model; boundary_ratio and flow_shift default to the folder's.
    """

    embeddings: PromptEmbeddings
    height: int
    width: int
    num_frames: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    condition_latents: tuple[torch.Tensor, ...] = ()  # image-to-video: exactly one
    guidance_scale_2: float | None = None
    boundary_ratio: float | None = None
    flow_shift: float | None = None
    step_cache_threshold: float | None = None  # None = the stage's setting, 0 = off
    lora: tuple[LoraUse, ...] = ()  # adapters from the stage's `lora_dir`, on both transformers
    preview: PreviewOptions | None = None  # step previews of the middle frame (None: none)


@dataclass(frozen=True)
class _VideoPlan:
    """What a request fixes in `prepare` and every step reads."""

    timesteps: torch.Tensor
    boundary_timestep: float | None  # steps at t >= it run `transformer`, the others the second
    do_cfg: bool
    guidance_scale: float
    guidance_scale_2: float
    height: int
    width: int
    num_frames: int


@dataclass
class _VideoWork:
    """What a request holds while it runs; dropped on release."""

    latents: torch.Tensor  # float32 [1, z, F_lat, h, w], as the pipelines keep them
    embeddings: PromptEmbeddings  # in the transformer's dtype
    scheduler: UniPCMultistepScheduler  # the request's own: step() keeps its history
    condition: torch.Tensor | None  # image-to-video: [1, temporal + z, F_lat, h, w] float32

    def scheduler_step(self, noise_pred: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        stepped: torch.Tensor = self.scheduler.step(
            noise_pred, t, self.latents, return_dict=False
        )[0]
        return stepped


class VideoDenoiseState(StepState[_VideoPlan, _VideoWork]):
    """A text-to-video or image-to-video request while it runs (`StepState`)."""


@dataclass(frozen=True)
class _Row:
    """One row of a forward: a state's model input under one of its prompts."""

    state: int  # index in the step's states
    meta: RowMeta  # its request and branch
    model: int  # 0: transformer, 1: transformer_2
    hidden: torch.Tensor  # [1, in_channels, F_lat, h, w] in the transformer's dtype
    timestep: torch.Tensor  # scalar
    embeds: torch.Tensor  # [1, seq, text_dim]


class WanDenoiseAdapter:
    """The DiT stage's model for Wan: WanTransformer3DModel(s) + UniPC, one step per tick."""

    stage = "dit"
    #: How the folder's latents become previews (`load_painter`): None = no step previews.
    painter: Painter | None

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_steps: int = 200,
        max_pixels: int = 1024 * 1024,
        max_side: int = 2048,
        max_true_cfg_scale: float = 20.0,
        max_frames: int = DEFAULT_MAX_FRAMES,
        max_video_pixels: int | None = None,
        placement: Placement = CPU_FLOAT32,
        step_cache: StepCacheConfig | None = None,
        lora: LoraConfig | None = None,
        preview_painter: PainterChoice = PainterChoice.PROJECTION,
    ) -> None:
        """max_video_pixels: frames x height x width; None: DEFAULT_MAX_VIDEO_PIXELS or, if
        less, what max_frames and max_pixels allow. placement: where the transformers compute,
        and in what dtype; the latents stay in float32 there (as in the pipelines) and leave on
        the CPU. step_cache: the stage's step cache (None: off). lora: its adapters (None: off;
        each goes into every transformer, as diffusers' `load_into_transformer_2`).
        preview_painter: what paints step previews of the middle frame (`load_painter`)."""
        folder = WanFolder.read(model_dir)
        names = ["transformer", SECOND_TRANSFORMER][: 1 + folder.has_second_transformer]
        transformers = [
            WanTransformer3DModel.from_pretrained(
                model_dir,
                subfolder=name,
                local_files_only=True,
                dtype=placement.dtype,
                device_map=placement.device_name,  # straight onto the device
            )
            for name in names
        ]
        scheduler = UniPCMultistepScheduler.from_pretrained(
            model_dir, subfolder="scheduler", local_files_only=True
        )
        self.folder = folder
        self.transformers: list[WanTransformer3DModel] = [t.eval() for t in transformers]
        self.scheduler = scheduler
        self._check_model()
        self.placement = Placement(self.transformers[0].device, self.transformers[0].dtype)
        self._device = self.placement.device
        self._dtype = self.placement.dtype
        self._pacer = LaunchPacer(self._device)
        self._hooks = BlockInterruptHooks(self._pacer)
        self.step_cache = StepCache(step_cache or StepCacheConfig())
        self.loras = LoraCatalog(lora or LoraConfig())
        self.lora_slots = (
            SlotBank(self.transformers, self.loras, WanLoraLoaderMixin.lora_state_dict)
            if self.loras.config.enabled
            else None
        )
        #: The parallel group this rank 0 runs its forwards over (services/dit/parallel.py).
        self.group: GroupForward | None = None
        self.painter = load_painter(model_dir, self._device, preview_painter)
        self.limits = self._limits(
            max_steps=max_steps,
            max_pixels=max_pixels,
            max_side=max_side,
            max_true_cfg_scale=max_true_cfg_scale,
            max_frames=max_frames,
            max_video_pixels=max_video_pixels,
        )

    def _check_model(self) -> None:
        """The folder's parts agree: channels as the task needs, one patch size, no image
        embeddings (Wan 2.1 I2V), a flow-matching UniPC schedule."""
        folder, config = self.folder, self.transformers[0].config
        geometry = folder.geometry
        # image-to-video: noise, then the first-frame mask (temporal_factor channels), then the
        # condition image's latents
        condition = geometry.temporal_factor + geometry.z_dim
        want = geometry.z_dim + (condition if folder.task == "image-to-video" else 0)
        for transformer in self.transformers:
            if transformer.config["in_channels"] != want:
                raise ValueError(
                    f"{folder.task}: transformer in_channels must be {want}, "
                    f"got {transformer.config['in_channels']}"
                )
            if transformer.config["image_dim"] is not None:
                raise ValueError("Wan transformers with image embeddings are not supported")
            if list(transformer.config["patch_size"]) != list(config["patch_size"]):
                raise ValueError("the two transformers have different patch sizes")
        if len(set(geometry.size_multiple)) != 1:
            raise ValueError(f"height and width multiples differ: {geometry.size_multiple}")
        if not self.scheduler.config.get("use_flow_sigmas"):
            raise ValueError("the Wan scheduler must use flow sigmas (use_flow_sigmas)")

    def _limits(
        self,
        *,
        max_steps: int,
        max_pixels: int,
        max_side: int,
        max_true_cfg_scale: float,
        max_frames: int,
        max_video_pixels: int | None,
    ) -> DitLimits:
        """The Qwen DiT's image limits (`image_limits`: the same options, caps and rounding),
        then the video ones; the rotary table (`rope_max_seq_len` positions per axis) caps
        both."""
        folder = self.folder
        multiple = folder.geometry.size_multiple[0]
        positions: int = min(t.config["rope_max_seq_len"] for t in self.transformers)
        side_cap = capped_option("max_side", max_side, positions * multiple)
        image = image_limits(
            multiple,
            min_steps=scheduler_min_steps(self.scheduler),
            max_steps=max_steps,
            max_pixels=max_pixels,
            max_side=side_cap,
            max_true_cfg_scale=max_true_cfg_scale,
            max_images_per_request=1,  # one video per request
        )
        step = folder.geometry.frame_multiple
        frames_cap = (positions - 1) * step + 1
        frames = (capped_option("max_frames", max_frames, frames_cap) - 1) // step * step + 1
        valid = self._frame_counts(frames)
        if not valid:
            raise ValueError(f"max_frames {frames} allows no clip of whole transformer patches "
                             f"(patch_size[0] {folder.geometry.patch[0]} latent frames)")
        frames = valid[-1]
        video_cap = frames * image.max_pixels
        if max_video_pixels is None:
            max_video_pixels = min(DEFAULT_MAX_VIDEO_PIXELS, video_cap)
        return replace(
            image,
            max_frames=frames,
            frame_multiple=step,
            frame_patch=folder.geometry.patch[0],
            max_condition_images=1 if folder.task == "image-to-video" else 0,
            has_second_transformer=folder.has_second_transformer,
            accepts_flow_shift=not self.scheduler.config.get("use_dynamic_shifting"),
            task=folder.task,
            max_video_pixels=capped_option("max_video_pixels", max_video_pixels, video_cap),
        )

    # -- validation ---------------------------------------------------------------------------

    def check_inputs(self, payload: VideoDenoiseInput) -> None:
        limits = self.limits
        checks.check_size(limits, payload.height, payload.width)
        self._check_frames(payload)
        checks.check_steps(limits, payload.num_inference_steps)
        checks.check_scale("guidance_scale", payload.guidance_scale, limits.max_true_cfg_scale)
        checks.check_seed(payload.seed)
        self._check_second_transformer(payload)
        self._check_flow_shift(payload.flow_shift)
        self._check_embeddings(payload)
        self._check_conditions(payload)
        self.step_cache.config.request_threshold(payload.step_cache_threshold)
        check_options(payload.preview, self.painter)
        self.loras.check(payload.lora)
        if self.group is not None:
            check_tokens(self.group.degrees, self._tokens(payload))

    def _tokens(self, payload: VideoDenoiseInput) -> int:
        """The video tokens of one row: latent frames x patches per latent frame."""
        patch, side = self.transformers[0].config["patch_size"], self.limits.size_multiple
        frames = self.folder.geometry.latent_frames(payload.num_frames) // patch[0]
        return int(frames * (payload.height // side) * (payload.width // side))

    def _frame_counts(self, max_frames: int) -> list[int]:
        """The frame counts up to `max_frames` the transformer can take: 4k+1 frames whose
        latent frames are a whole number of its patches in time (`patch_size[0]`; a
        transformer with 3 latent frames per token takes 9, 21, 33 ... frames, not 5)."""
        geometry = self.folder.geometry
        step = geometry.frame_multiple
        return [
            frames
            for frames in range(1, max_frames + 1, step)
            if geometry.latent_frames(frames) % geometry.patch[0] == 0
        ]

    def _check_frames(self, payload: VideoDenoiseInput) -> None:
        """4k+1 frames of whole temporal patches, at most max_frames, and frames x pixels at
        most max_video_pixels."""
        limits, frames = self.limits, payload.num_frames
        step, patch = limits.frame_multiple, self.folder.geometry.patch[0]
        if not (1 <= frames <= limits.max_frames and (frames - 1) % step == 0):
            raise InvalidInputError(
                "num_frames",
                f"num_frames must be {step}*k+1 in [1, {limits.max_frames}], got {frames}",
            )
        if self.folder.geometry.latent_frames(frames) % patch:
            valid = self._frame_counts(limits.max_frames)
            shown = ", ".join(map(str, valid[:4]))
            if len(valid) > 4:
                shown += f", ... {valid[-1]}"
            raise InvalidInputError(
                "num_frames",
                f"num_frames must be one of {shown} (this transformer takes {patch} latent "
                f"frames per token, and {step}*k+1 frames are k+1 latent frames), got {frames}",
            )
        if frames * payload.height * payload.width > limits.max_video_pixels:
            raise InvalidInputError(
                "num_frames",
                f"{frames} frames of {payload.height}x{payload.width} are more than "
                f"{limits.max_video_pixels} pixels",
            )

    def _check_second_transformer(self, payload: VideoDenoiseInput) -> None:
        for name, value in (
            ("guidance_scale_2", payload.guidance_scale_2),
            ("boundary_ratio", payload.boundary_ratio),
        ):
            if value is not None and not self.limits.has_second_transformer:
                raise InvalidInputError(name, f"{name}: this model has no second transformer")
        if payload.guidance_scale_2 is not None:
            scale_2 = payload.guidance_scale_2
            checks.check_scale("guidance_scale_2", scale_2, self.limits.max_true_cfg_scale)
            if scale_2 > 1 and payload.guidance_scale <= 1:
                raise InvalidInputError(
                    "guidance_scale_2",
                    "guidance_scale_2 > 1 needs guidance_scale > 1 (the pipeline guides only "
                    "then)",
                )
        ratio = payload.boundary_ratio
        if ratio is not None and not (math.isfinite(ratio) and 0.0 <= ratio <= 1.0):
            raise InvalidInputError(
                "boundary_ratio", f"boundary_ratio must be in [0, 1], got {ratio}"
            )

    def _check_flow_shift(self, shift: float | None) -> None:
        if shift is None:
            return
        if not self.limits.accepts_flow_shift:
            raise InvalidInputError("flow_shift", "this model's scheduler takes no flow_shift")
        if not (math.isfinite(shift) and 0.0 < shift <= MAX_FLOW_SHIFT):
            raise InvalidInputError(
                "flow_shift", f"flow_shift must be in (0, {MAX_FLOW_SHIFT}], got {shift}"
            )

    def _check_embeddings(self, payload: VideoDenoiseInput) -> None:
        """Shapes and values as the Qwen DiT checks them; Wan attends to every text token (the
        pipeline zero-pads, it passes no mask), so a mask that hides tokens is refused."""
        emb, dim = payload.embeddings, self.transformers[0].config["text_dim"]
        limit = PROMPT_MAX_TOKENS  # the pipelines zero-pad every prompt to it
        checks.check_embeds("prompt_embeds", emb.prompt_embeds, emb.prompt_embeds_mask, dim, limit)
        if emb.negative_prompt_embeds is not None:
            neg, neg_mask = emb.negative_prompt_embeds, emb.negative_prompt_embeds_mask
            checks.check_embeds("negative_prompt_embeds", neg, neg_mask, dim, limit)
        elif payload.guidance_scale > 1:
            raise InvalidInputError(
                "negative_prompt_embeds",
                "guidance_scale > 1 needs negative_prompt_embeds (the pipeline encodes \"\")",
            )
        for mask in (emb.prompt_embeds_mask, emb.negative_prompt_embeds_mask):
            if mask is not None and not bool((mask != 0).all()):
                raise InvalidInputError(
                    "embeddings", "Wan attends to every text token: send no mask (zero padding)"
                )

    def _check_conditions(self, payload: VideoDenoiseInput) -> None:
        conditions = payload.condition_latents
        want = self.limits.max_condition_images
        if len(conditions) != want:
            what = "exactly one image's latents" if want else "no condition_latents"
            raise InvalidInputError(
                "condition_latents", f"a {self.folder.task} model takes {what}, "
                f"got {len(conditions)}"
            )
        shape = self.folder.latent_shape(payload.num_frames, payload.height, payload.width)
        for latents in conditions:
            if tuple(latents.shape) != shape:
                raise InvalidInputError(
                    "condition_latents",
                    f"condition_latents must be {list(shape)} (VAE EncodeImage of the image at "
                    f"{payload.height}x{payload.width} with num_frames={payload.num_frames}), "
                    f"got {list(latents.shape)}",
                )
            checks.check_finite("condition_latents", "condition_latents", latents)

    # -- step machine -------------------------------------------------------------------------

    @torch.inference_mode()
    def prepare(self, request: EngineRequest[VideoDenoiseInput]) -> VideoDenoiseState:
        payload = request.payload
        scheduler = self._scheduler(payload.flow_shift)
        scheduler.set_timesteps(payload.num_inference_steps, device=self._device)
        scheduler.set_begin_index(0)
        boundary = (
            payload.boundary_ratio
            if payload.boundary_ratio is not None
            else self.folder.boundary_ratio
        )
        plan = _VideoPlan(
            timesteps=scheduler.timesteps,
            boundary_timestep=boundary_timestep(
                boundary if self.folder.has_second_transformer else None,
                scheduler.config["num_train_timesteps"],
            ),
            do_cfg=payload.guidance_scale > 1,
            guidance_scale=payload.guidance_scale,
            guidance_scale_2=(
                payload.guidance_scale
                if payload.guidance_scale_2 is None
                else payload.guidance_scale_2
            ),
            height=payload.height,
            width=payload.width,
            num_frames=payload.num_frames,
        )
        work = _VideoWork(
            latents=self.prepare_latents(payload),
            embeddings=payload.embeddings.to(self._device, self._dtype),
            scheduler=scheduler,
            condition=self.prepare_condition(payload),
        )
        threshold = self.step_cache.config.request_threshold(payload.step_cache_threshold)
        return VideoDenoiseState(
            plan=plan,
            work=work,
            request_id=request.request_id,
            cache=self.step_cache.new_row(threshold),
            preview=self._previewer(payload.preview, scheduler),
            lora=self.lora_slots.hold(payload.lora) if self.lora_slots else None,
        )

    def _previewer(self, options: PreviewOptions | None,
                   scheduler: UniPCMultistepScheduler) -> Previewer | None:
        """Previews of the middle latent frame [z, h, w] (UniPC's flow sigmas give its x0)."""
        if options is None or self.painter is None:
            return None
        return Previewer(options, self.painter, scheduler.sigmas,
                         lambda latents: latents[0, :, latents.shape[2] // 2],
                         preview_histogram())

    def add_input(self, state: VideoDenoiseState, payload: NoStream) -> None:
        assert_never(payload)  # the DiT stage takes no streamed input

    @torch.inference_mode()
    def step(self, states: Sequence[VideoDenoiseState]) -> list[StepOutput[Preview]]:
        """One denoising step for every state: a forward per (transformer, text length) group.

        Nothing is written to a state until every forward is done: one that raises
        (StepInterrupted included) leaves all states as they were."""
        check_one_batch(states, _video_shape, "video shape")
        if self.lora_slots is not None:  # states whose adapters are not attached yet wait
            return self.lora_slots.step_attached(states, self._step)
        return self._step(states)

    def _step(self, states: Sequence[VideoDenoiseState]) -> list[StepOutput[Preview]]:
        return step_batch(states, self._predict, self._device)

    def finish(self, state: VideoDenoiseState) -> DenoisedLatents:
        """The latents [1, z, F_lat, h, w] float32, handed over on the CPU."""
        plan = state.plan
        latents = state.live().latents.to(CPU)
        return DenoisedLatents(latents, plan.height, plan.width, num_frames=plan.num_frames)

    def release(self, state: VideoDenoiseState) -> None:
        state.release(self.step_cache, self.lora_slots)

    def batch_key(self, state: VideoDenoiseState) -> Hashable:
        """The video shape: rows of one forward must share it."""
        return _video_shape(state)

    def bind_interrupt(self, interrupt: StepInterrupt) -> None:
        """Check `interrupt` before every block of every transformer; in a group, every rank
        votes on it there."""
        if self.group is not None:
            self.group.bind_interrupt(interrupt)
            return
        self._hooks.bind(interrupt, [b for t in self.transformers for b in t.blocks])

    # -- phases (the pipelines' steps 4-6) ----------------------------------------------------

    def _scheduler(self, flow_shift: float | None) -> UniPCMultistepScheduler:
        """A fresh scheduler from the folder's config (with the request's shift if given)."""
        overrides = {} if flow_shift is None else {"flow_shift": flow_shift}
        scheduler: UniPCMultistepScheduler = UniPCMultistepScheduler.from_config(
            self.scheduler.config, **overrides
        )
        return scheduler

    def prepare_latents(self, payload: VideoDenoiseInput) -> torch.Tensor:
        """Seeded float32 noise, drawn on the CPU as `prepare_latents` draws it."""
        shape = self.folder.latent_shape(payload.num_frames, payload.height, payload.width)
        return seeded_noise(shape, payload.seed, self._device, torch.float32)

    def prepare_condition(self, payload: VideoDenoiseInput) -> torch.Tensor | None:
        """Image-to-video: [first-frame mask, image latents] along channels, as
        `WanImageToVideoPipeline.prepare_latents` returns its condition."""
        if not payload.condition_latents:
            return None
        latents = payload.condition_latents[0].to(self._device, torch.float32)
        _, _, _, height, width = latents.shape
        temporal = self.folder.geometry.temporal_factor
        mask = i2v_condition_mask(payload.num_frames, temporal, height, width)
        return torch.cat([mask.to(self._device), latents], dim=1)

    def _model(self, state: VideoDenoiseState) -> int:
        """0 (`transformer`) at or above the boundary timestep or without one, else 1."""
        boundary = state.plan.boundary_timestep
        return 0 if boundary is None or bool(state.timestep() >= boundary) else 1

    def _predict(self, states: Sequence[VideoDenoiseState]) -> list[Prediction]:
        """Each state's noise prediction, guidance applied; the rows' step caches take this
        step's entries once every prediction is made."""
        rows = [self._row(i, state, negative=False) for i, state in enumerate(states)]
        rows += [
            self._row(i, state, negative=True)
            for i, state in enumerate(states)
            if state.plan.do_cfg
        ]
        groups: dict[tuple[int, int], list[_Row]] = {}
        for row in rows:
            groups.setdefault((row.model, row.embeds.shape[1]), []).append(row)
        cache = self.step_cache.begin()
        out: dict[tuple[int, Branch], tuple[torch.Tensor, bool]] = {}
        for (model, _), members in groups.items():
            slots = [
                cache.slot(
                    states[row.state].cache,
                    row.meta.branch,
                    states[row.state].step_index,
                    len(states[row.state].plan.timesteps),
                    model,
                )
                for row in members
            ]
            transformer = self.transformers[model]
            outputs = forward_rows(
                cache,
                slots,
                lambda run, hooks, m=members, t=transformer: self._forward(  # type: ignore[misc]
                    t, [m[i] for i in run], hooks
                ),
            )
            for row, slot, output in zip(members, slots, outputs, strict=True):
                out[(row.state, row.meta.branch)] = (output, slot.reused)
        predictions = []
        for i, state in enumerate(states):
            cond, reused = out[(i, Branch.COND)]
            if state.plan.do_cfg:
                scale = (state.plan.guidance_scale, state.plan.guidance_scale_2)[self._model(state)]
                uncond, uncond_reused = out[(i, Branch.UNCOND)]
                cond = uncond + scale * (cond - uncond)
                reused = reused and uncond_reused
            predictions.append(Prediction(cond, reused))
        cache.commit()
        return predictions

    def _row(self, index: int, state: VideoDenoiseState, *, negative: bool) -> _Row:
        work = state.live()
        latents = work.latents
        if work.condition is not None:
            latents = torch.cat([latents, work.condition], dim=1)
        emb = work.embeddings
        embeds = emb.negative_prompt_embeds if negative else emb.prompt_embeds
        if embeds is None:
            raise RuntimeError("guidance planned without negative embeddings")
        return _Row(
            state=index,
            meta=RowMeta(
                state.request_id,
                Branch.UNCOND if negative else Branch.COND,
                state.lora.slots or () if state.lora else (),
            ),
            model=self._model(state),
            hidden=latents.to(self._dtype),
            timestep=state.timestep(),
            embeds=embeds,
        )

    def _forward(
        self,
        transformer: WanTransformer3DModel,
        rows: Sequence[_Row],
        hooks: RowHooks | None = None,
    ) -> torch.Tensor:
        """One forward over `rows` (one video shape, one text length): [rows, z, F, h, w]."""
        self._pacer.reset()
        forward = wan_forward if self.group is None else self.group.wan
        return forward(
            transformer,
            hidden_states=torch.cat([row.hidden for row in rows]),
            timestep=torch.stack([row.timestep for row in rows]),
            encoder_hidden_states=torch.cat([row.embeds for row in rows]),
            rows=[row.meta for row in rows],
            hooks=hooks,
            adapters=self.lora_slots,
        )

    def step_cache_bytes_per_row(self) -> int:
        """What one guided request's step cache holds at most: max_frames at the most pixels
        max_video_pixels leaves each of them (one token per size_multiple^2 pixels per latent
        frame)."""
        limits, config, geometry = self.limits, self.transformers[0].config, self.folder.geometry
        pixels = min(limits.max_pixels, limits.max_video_pixels // limits.max_frames)
        frames = geometry.latent_frames(limits.max_frames) // config["patch_size"][0]
        tokens = frames * (pixels // limits.size_multiple**2)
        hidden = config["num_attention_heads"] * config["attention_head_dim"]
        # the output: z channels x every latent pixel of the patches
        output = tokens * geometry.z_dim * prod(config["patch_size"])
        return self.step_cache.config.bytes_per_row(tokens, hidden, output, self._dtype.itemsize)


def _video_shape(state: VideoDenoiseState) -> tuple[int, int, int]:
    """(frames, height, width): the rows of one forward share it."""
    return (state.plan.num_frames, state.plan.height, state.plan.width)


#: The static proof that the adapter is the DiT stage's StageAdapter.
_: type[
    StageAdapter[VideoDenoiseInput, NoStream, VideoDenoiseState, Preview, DenoisedLatents]
] = WanDenoiseAdapter
_interruptible: type[Interruptible] = WanDenoiseAdapter
