"""An image request: what the client asked (ImageRequest), and what will run (ImageParams).

The client's fields are read once into an ImageRequest (from OpenAI JSON or the gRPC message);
`resolve_image_request` then fills the recipe's defaults and checks every field against what
the Tokenizer, DiT and VAE publish, before any stage is called. Each refusal names its field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.mesh.catalog import ExecutionMode, ImageFacts
from stagemesh.gateway.recipes import ImageDefaults
from stagemesh.gateway.seeds import random_seed
from stagemesh.shared.limits import MAX_SEED
from stagemesh.shared.proto.v1 import common_pb2

_SIZE = re.compile(r"^\s*(\d{1,5})\s*[xX]\s*(\d{1,5})\s*$")

#: The priorities a client may ask for: lower runs sooner (as in vLLM); 0 when not given.
PRIORITY_RANGE = range(-1000, 1001)

#: Execution modes by their REST names.
EXECUTION_MODES: dict[str, ExecutionMode] = {"step": common_pb2.EXECUTION_MODE_STEP,
                                             "request": common_pb2.EXECUTION_MODE_REQUEST}


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
    negative = defaults.negative_prompt if request.negative_prompt is None \
        else request.negative_prompt
    return ImageParams(prompt=request.prompt, negative_prompt=negative, n=n, width=width,
                       height=height, num_inference_steps=steps, true_cfg_scale=scale,
                       seed=seed, execution_mode=request.execution_mode,
                       priority=_priority(request.priority))
