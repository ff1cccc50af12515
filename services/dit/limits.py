"""What a DiT stage accepts (its Describe facts), one owner for every DiT model's adapter.

The image limits (size, steps, guidance scale) follow one rule whatever the model: the
operator's options, tightened to the model's caps. The Qwen-Image adapter publishes them as
they are; the Wan adapter builds on them and adds the video facts.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffusers.configuration_utils import ConfigMixin

from stagemesh.models.families.qwen_image import EDIT_IMAGE_AREA, MAX_IMAGE_SIDE
from stagemesh.models.options import capped_option

#: Output pixels a text-to-image model allows unless the recipe sets `max_pixels`.
DEFAULT_MAX_PIXELS = 1024 * 1024
# The model's own caps: no option can raise a limit above these.
MAX_STEPS = 1000
MAX_TRUE_CFG_SCALE = 30.0


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
    # Video and conditioning facts (services/dit/wan_adapter.py sets them for Wan models).
    max_frames: int = 0  # 0: an image model
    frame_multiple: int = 0  # num_frames = frame_multiple * k + 1 (Wan: 4)
    #: latent frames per transformer token: a clip's latent frames are a multiple of it
    frame_patch: int = 0
    has_second_transformer: bool = False  # guidance_scale_2 / boundary_ratio apply
    accepts_flow_shift: bool = False  # flow_shift may be set per request
    max_video_pixels: int = 0  # num_frames x height x width; 0: an image model
    #: condition_latents one request carries: 0 = the model takes none (text-to-image); an
    #: edit model takes exactly this many (QwenImageEditPipeline: one input image).
    max_condition_images: int = 0
    task: str = "text-to-image"  # DescribeDitResponse.task


def scheduler_min_steps(scheduler: ConfigMixin) -> int:
    """A schedule stretched to a terminal shift divides by (1 - its last timestep) / (1 -
    shift_terminal): with one step that is 0 / x and the latents become NaN (stock diffusers
    too), so such a model needs two steps at least. FlowMatch and Wan's UniPC stretch alike."""
    return 2 if scheduler.config.get("shift_terminal") else 1


def image_limits(
    factor: int,
    *,
    edit: bool = False,
    condition_area: int = EDIT_IMAGE_AREA,
    min_steps: int,
    max_steps: int,
    max_pixels: int | None,
    max_side: int,
    max_true_cfg_scale: float,
    max_images_per_request: int,
) -> DitLimits:
    """The operator's options, tightened to the model's caps; sides round down to a multiple
    of the latent factor (a side that no size can reach would be a false promise)."""
    side = capped_option("max_side", max_side, MAX_IMAGE_SIDE) // factor * factor
    if side < factor:
        raise ValueError(f"option max_side={max_side} is below the model's size multiple {factor}")
    if max_pixels is None:
        default = edit_pixels_bound(side, condition_area) if edit else DEFAULT_MAX_PIXELS
        max_pixels = min(default, side * side)
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
        max_condition_images=1 if edit else 0,
        task="image-edit" if edit else "text-to-image",
    )


def edit_pixels_bound(max_side: int, condition_area: int = EDIT_IMAGE_AREA) -> int:
    """The most pixels of a size the edit pipeline's default-size rule makes with no side above
    `max_side`: `edit_image_size` (`calculate_dimensions(condition_area, ratio)`) rounds each
    side of a W0 x H0 = area rectangle to a multiple of 32, so W x H <= area + 16 (W0 + H0) +
    256, and W <= max_side means W0 < max_side + 16 (likewise H0), which bounds W0 + H0. Both
    the condition image (the pipeline resizes the input to that size) and, by default, the
    output have that size, so an edit model's default `max_pixels` admits every one of them."""
    area, longest = condition_area, max_side + 16
    return area + 16 * (longest + -(-area // longest)) + 256
