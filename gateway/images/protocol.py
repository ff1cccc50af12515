"""An image request: what the client asked (ImageRequest), and what will run (ImageParams).

The client's fields are read once into an ImageRequest (from OpenAI JSON or the gRPC message);
`resolve_image_request` then fills the recipe's defaults and checks every field against what
the Tokenizer, DiT and VAE publish, before any stage is called. Each refusal names its field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from stagemesh.gateway.core import random_seed
from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.mesh.stages import ExecutionMode, ImageFacts, LoraChoice
from stagemesh.gateway.recipes import ImageDefaults
from stagemesh.gateway.wire.requests import TEXT_BODY_BYTES, JsonFields, parse_lora
from stagemesh.shared.limits import MAX_SEED
from stagemesh.shared.proto.v1 import common_pb2

_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*$")

#: POST /v1/images/generations and GenerateImage carry text only.
GENERATION_BODY_BYTES = TEXT_BODY_BYTES

#: The priorities a client may ask for: lower runs sooner (as in vLLM); 0 when not given.
PRIORITY_RANGE = range(-1000, 1001)

#: Execution modes by their REST names.
EXECUTION_MODES: dict[str, ExecutionMode] = {"step": common_pb2.EXECUTION_MODE_STEP,
                                             "request": common_pb2.EXECUTION_MODE_REQUEST}


@dataclass(frozen=True)
class PreviewAsk:
    """Step previews a client asked for: every `every` steps, `size` px on the long side
    (None: the DiT's default)."""

    every: int
    size: int | None = None


@dataclass(frozen=True)
class ImageRequest:
    """An image request as the client sent it; None = not given (default or random)."""

    prompt: str
    model: str = ""
    negative_prompt: str | None = None
    n: int | None = None
    width: int | None = None
    height: int | None = None
    num_inference_steps: int | None = None
    true_cfg_scale: float | None = None
    seed: int | None = None
    execution_mode: ExecutionMode = common_pb2.EXECUTION_MODE_UNSPECIFIED
    priority: int | None = None
    step_cache_threshold: float | None = None
    preview: PreviewAsk | None = None
    lora: tuple[LoraChoice, ...] = ()


@dataclass(frozen=True)
class ImageParams:
    """A validated image request (every field concrete)."""

    prompt: str
    negative_prompt: str | None
    n: int
    width: int
    height: int
    num_inference_steps: int
    true_cfg_scale: float
    seed: int
    execution_mode: ExecutionMode = common_pb2.EXECUTION_MODE_UNSPECIFIED
    priority: int = 0  # in the DiT's queue: lower runs sooner
    step_cache_threshold: float | None = None  # None: the DiT's own setting; 0: off
    preview: PreviewAsk | None = None  # step previews (every and size concrete); None: none
    lora: tuple[LoraChoice, ...] = ()  # checked against the DiT's published adapters


def parse_size(size: str) -> tuple[int, int]:
    """'WxH' -> (width, height); InvalidRequest naming `size` otherwise."""
    match = _SIZE.match(size)
    if not match:
        raise InvalidRequest("size", f"size must look like '512x512' (WxH), got {size!r}")
    return int(match.group(1)), int(match.group(2))


def _check_prompts(request: ImageRequest, facts: ImageFacts) -> None:
    if not request.prompt.strip():
        raise InvalidRequest("prompt", "prompt must be a non-empty string")
    for name, text in (("prompt", request.prompt),
                       ("negative_prompt", request.negative_prompt or "")):
        if len(text) > facts.max_prompt_chars:
            raise InvalidRequest(name, f"{name} is longer than {facts.max_prompt_chars} "
                                 "characters")


def _check_size(width: int, height: int, facts: ImageFacts) -> None:
    for name, value in (("width", width), ("height", height)):
        if value <= 0 or value % facts.size_multiple:
            raise InvalidRequest("size", f"{name} must be a positive multiple of "
                                 f"{facts.size_multiple} for this model, got {value}")
        if facts.max_side and value > facts.max_side:
            raise InvalidRequest("size", f"{name} must be at most {facts.max_side} pixels, "
                                 f"got {value}")
    if width * height > facts.max_pixels:
        raise InvalidRequest("size", f"{width}x{height} exceeds the limit of "
                             f"{facts.max_pixels} pixels")


def _check_mode(mode: ExecutionMode, facts: ImageFacts) -> None:
    if mode != common_pb2.EXECUTION_MODE_UNSPECIFIED and mode not in facts.execution_modes:
        offered = [name for name, value in EXECUTION_MODES.items()
                   if value in facts.execution_modes]
        raise InvalidRequest("execution_mode", f"execution_mode must be one of {offered}")


def _priority(priority: int | None) -> int:
    if priority is None:
        return 0
    if priority not in PRIORITY_RANGE:
        raise InvalidRequest("priority", f"priority must be between {PRIORITY_RANGE.start} and "
                             f"{PRIORITY_RANGE.stop - 1} (lower runs sooner), got {priority}")
    return priority


def step_cache_threshold(value: float | None, facts: ImageFacts) -> float | None:
    """A request's step cache threshold against what the DiT publishes: None = the stage's
    setting, 0 = off, at most its maximum; a taylorseer stage forecasts on a fixed schedule, so
    it takes 0 or its own setting only."""
    if value is None or value == 0:
        return value
    # the stage publishes its setting as a proto float: compare at that precision
    if facts.step_cache == "taylorseer" and np.float32(value) != np.float32(
            facts.step_cache_threshold):
        raise InvalidRequest("step_cache_threshold", "this model's DiT runs a taylorseer step "
                             f"cache: step_cache_threshold must be 0 (off) or "
                             f"{facts.step_cache_threshold:g}, got {value:g}")
    if not 0 < value <= facts.max_step_cache_threshold:
        raise InvalidRequest("step_cache_threshold", "step_cache_threshold must be in "
                             f"[0, {facts.max_step_cache_threshold:g}] for this model "
                             f"(0 = off), got {value:g}")
    return value


def resolve_preview(ask: PreviewAsk | None, facts: ImageFacts) -> PreviewAsk | None:
    """A request's previews against what the DiT publishes (a 400 naming `preview`); every 0
    is none. A model that makes no previews (its DiT publishes max_preview_size 0) runs
    the request without them: they are a view of the work, not part of its result, and a page
    that asks for them by default (the playground) must work with every model."""
    if ask is None or ask.every == 0 or facts.max_preview_size <= 0:
        return None
    if ask.every < max(1, facts.min_preview_every):
        raise InvalidRequest("preview", f"preview.every must be at least "
                             f"{max(1, facts.min_preview_every)}, got {ask.every}")
    size = facts.default_preview_size if ask.size is None else ask.size
    if not 1 <= size <= facts.max_preview_size:
        raise InvalidRequest("preview", f"preview.size must be in [1, {facts.max_preview_size}]"
                             f", got {size}")
    return PreviewAsk(ask.every, size)


def resolve_image_request(request: ImageRequest, defaults: ImageDefaults,
                          facts: ImageFacts) -> ImageParams:
    """Fill the recipe's defaults and check every field against the stages' published facts."""
    _check_prompts(request, facts)
    n = 1 if request.n is None else request.n
    if not 1 <= n <= facts.max_images_per_request:
        raise InvalidRequest("n", f"n must be between 1 and {facts.max_images_per_request}, "
                             f"got {n}")
    width, height = request.width or defaults.width, request.height or defaults.height
    _check_size(width, height, facts)
    steps = (defaults.num_inference_steps if request.num_inference_steps is None
             else request.num_inference_steps)
    if not facts.min_steps <= steps <= facts.max_steps:
        raise InvalidRequest("num_inference_steps", f"num_inference_steps must be between "
                             f"{facts.min_steps} and {facts.max_steps}, got {steps}")
    scale = defaults.true_cfg_scale if request.true_cfg_scale is None else request.true_cfg_scale
    if not 0.0 <= scale <= facts.max_true_cfg_scale:
        raise InvalidRequest("true_cfg_scale", f"true_cfg_scale must be in "
                             f"[0, {facts.max_true_cfg_scale:g}], got {scale}")
    seed = random_seed() if request.seed is None else request.seed
    if not 0 <= seed <= MAX_SEED - n:
        raise InvalidRequest("seed", f"seed must be between 0 and {MAX_SEED - n}, got {seed}")
    _check_mode(request.execution_mode, facts)
    facts.lora.check(request.lora)
    negative = defaults.negative_prompt if request.negative_prompt is None \
        else request.negative_prompt
    return ImageParams(prompt=request.prompt, negative_prompt=negative, n=n, width=width,
                       height=height, num_inference_steps=steps, true_cfg_scale=scale,
                       seed=seed, execution_mode=request.execution_mode,
                       priority=_priority(request.priority),
                       step_cache_threshold=step_cache_threshold(request.step_cache_threshold,
                                                                 facts),
                       preview=resolve_preview(request.preview, facts), lora=request.lora)


def execution_mode(value: str | None) -> common_pb2.ExecutionMode.ValueType:
    """An `execution_mode` field's text (None = the DiT's default) -> the proto's enum."""
    if value is None:
        return common_pb2.EXECUTION_MODE_UNSPECIFIED
    if value not in EXECUTION_MODES:
        raise InvalidRequest("execution_mode",
                             f"execution_mode must be one of {sorted(EXECUTION_MODES)}")
    return EXECUTION_MODES[value]


def image_request(body: Mapping[str, object]) -> ImageRequest:
    """POST /v1/images/generations: OpenAI's fields plus stagemesh's extensions."""
    fields = JsonFields(body)
    size = fields.string("size")
    width, height = (parse_size(size) if size is not None
                     else (fields.integer("width"), fields.integer("height")))
    if body.get("response_format", "b64_json") != "b64_json":
        raise InvalidRequest("response_format", "only response_format 'b64_json' is supported")
    scale_field = "true_cfg_scale" if "true_cfg_scale" in body else "guidance_scale"
    return ImageRequest(
        prompt=fields.string("prompt") or "", model=fields.string("model") or "",
        negative_prompt=fields.string("negative_prompt"), n=fields.integer("n"),
        width=width, height=height,
        num_inference_steps=fields.integer("num_inference_steps"),
        true_cfg_scale=_cfg_scale(fields, scale_field), seed=fields.integer("seed"),
        execution_mode=execution_mode(fields.string("execution_mode")),
        priority=fields.integer("priority"),
        step_cache_threshold=fields.number("step_cache_threshold"),
        preview=parse_preview(body.get("preview")), lora=parse_lora(body.get("lora")))


def parse_preview(value: object) -> PreviewAsk | None:
    """`preview: {"every": k, "size": px}` (size optional); absent or null: none."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or set(value) - {"every", "size"}:
        raise InvalidRequest("preview", 'preview must look like {"every": 1, "size": 128}')
    fields = JsonFields(value)
    try:
        every, size = fields.integer("every"), fields.integer("size")
    except InvalidRequest:
        raise InvalidRequest("preview", "preview.every and preview.size must be integers") \
            from None
    return None if every is None else PreviewAsk(every, size)


def _cfg_scale(fields: JsonFields, name: str) -> float | None:
    """true_cfg_scale (alias guidance_scale); a refusal names true_cfg_scale either way."""
    try:
        return fields.number(name)
    except InvalidRequest:
        raise InvalidRequest("true_cfg_scale", "true_cfg_scale must be a number") from None
