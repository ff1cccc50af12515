"""A video request: what the client asked (VideoRequest), and what will run (VideoParams).

The client's fields are read once into a VideoRequest (from an OpenAI multipart form or the
gRPC message); `resolve_video_request` then fills the recipe's defaults and checks every field
against what the Tokenizer, DiT and VAE publish (catalog.VideoFacts), before any stage runs.
Each refusal names its field. The frame count follows the DiT's rule (`frame_multiple` * k + 1,
Wan's 4k+1, whose k + 1 latent frames are a multiple of `frame_patch`, the latent frames of one
transformer token): an explicit `num_frames` must keep it, while `seconds` x `fps` is rounded
up to it.

Decoding the input image is CPU work: call `resolve_video_request` off the event loop.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.images.edit_forms import preview_from_form
from stagemesh.gateway.images.edit_protocol import RgbImage, decode_image
from stagemesh.gateway.images.protocol import (
    ImageRequest,
    PreviewAsk,
    parse_preview,
    parse_size,
    resolve_image_request,
)
from stagemesh.gateway.mesh.stages import LoraChoice, VideoFacts
from stagemesh.gateway.recipes import ImageDefaults, VideoDefaults
from stagemesh.gateway.wire.forms import Form, FormFields
from stagemesh.gateway.wire.requests import MAX_BODY_BYTES, image_data_url, parse_lora_text
from stagemesh.shared.limits import MAX_FLOW_SHIFT

#: Frames per second an MP4 may play at.
MAX_FPS = 120
#: The longest video one may ask for in seconds (the frame limit the stages publish also holds).
MAX_SECONDS = 600.0
#: Largest input image (width x height) the gateway decodes for image-to-video; the VAE resizes
#: it to the video's size, so this only bounds the gateway's memory.
MAX_REFERENCE_PIXELS = 4096 * 4096


#: POST /v1/videos(/sync) and CreateVideo may carry an input image.
VIDEO_BODY_BYTES = MAX_BODY_BYTES
#: The create/sync form (or JSON object): its fields by type.
INTEGER_FIELDS = ("num_frames", "fps", "num_inference_steps", "seed", "preview_every",
                  "preview_size")
NUMBER_FIELDS = ("seconds", "guidance_scale", "guidance_scale_2", "boundary_ratio", "flow_shift",
                 "step_cache_threshold")
TEXT_FIELDS = ("model", "prompt", "negative_prompt", "size", "image_reference", "preview")
FORM_FIELDS = {*INTEGER_FIELDS, *NUMBER_FIELDS, *TEXT_FIELDS, "input_reference", "lora"}
#: Fields a JSON body may give as an object (the form holds their JSON text).
OBJECT_FIELDS = ("image_reference", "preview")
#: image_reference carries a whole image as a data URL.
LARGE_FIELDS = {"image_reference": 24 * 1024 * 1024}

@dataclass(frozen=True)
class VideoRequest:
    """A video request as the client sent it; None = not given (the recipe's default)."""

    prompt: str
    model: str = ""
    negative_prompt: str | None = None
    width: int | None = None
    height: int | None = None
    num_frames: int | None = None
    seconds: float | None = None
    fps: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    boundary_ratio: float | None = None
    flow_shift: float | None = None
    seed: int | None = None
    step_cache_threshold: float | None = None  # None: the DiT's own setting; 0: off
    #: Image-to-video: the first frame (PNG, JPEG or WebP bytes).
    image: bytes | None = None
    #: Which field the image came in (`input_reference` or `image_reference`), for errors.
    image_field: str = "input_reference"
    lora: tuple[LoraChoice, ...] = ()
    preview: PreviewAsk | None = None  # middle-frame step previews on :watch / WatchVideo


@dataclass(frozen=True)
class VideoParams:
    """A validated video request (every field concrete; the Wan 2.2 knobs None = the model's)."""

    prompt: str
    negative_prompt: str
    width: int
    height: int
    num_frames: int
    fps: int
    num_inference_steps: int
    guidance_scale: float
    seed: int
    guidance_scale_2: float | None = None
    boundary_ratio: float | None = None
    flow_shift: float | None = None
    step_cache_threshold: float | None = None  # None: the DiT's own setting; 0: off
    #: Image-to-video: the decoded first frame, uint8 RGB [H, W, 3] as the client sent it.
    image: RgbImage | None = None
    lora: tuple[LoraChoice, ...] = ()  # checked against the DiT's published adapters
    preview: PreviewAsk | None = None  # every and size concrete; None: none

    @property
    def seconds(self) -> float:
        return self.num_frames / self.fps


def image_from_reference(value: str) -> bytes:
    """The image of an `image_reference` field: JSON `{"image_url": "data:image/...;base64,..."}`
    (a bare data URL is taken too), decoded by wire/requests.image_data_url (remote URLs are
    refused: the server fetches nothing)."""
    text = value.strip()
    url: object = text
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except ValueError:
            raise InvalidRequest("image_reference", "image_reference must be JSON like "
                                 '{"image_url": "data:image/png;base64,..."}') from None
        url = parsed.get("image_url") if isinstance(parsed, dict) else None
        if isinstance(url, dict):  # the chat shape {"image_url": {"url": ...}}
            url = url.get("url")
    if not isinstance(url, str) or not url:
        raise InvalidRequest("image_reference", "image_reference needs an image_url (a data URL)")
    return image_data_url(url, "image_reference")


def allows_frames(frames: int, multiple: int, patch: int = 1) -> bool:
    """Whether a DiT whose rule is `multiple` * k + 1 frames, k + 1 latent frames a multiple of
    `patch`, takes `frames` (any count >= 1 for multiple <= 1)."""
    if frames < 1 or multiple <= 1:
        return frames >= 1
    return (frames - 1) % multiple == 0 and ((frames - 1) // multiple + 1) % patch == 0


def round_up_frames(frames: int, multiple: int, patch: int = 1) -> int:
    """The smallest count at least `frames` the rule allows (`allows_frames`)."""
    count = max(1, frames)
    while not allows_frames(count, multiple, patch):  # fewer than multiple * patch steps
        count += 1
    return count


def _rule(multiple: int, patch: int = 1) -> str:
    first = [round_up_frames(1, multiple, patch)]
    for _ in range(2):
        first.append(round_up_frames(first[-1] + 1, multiple, patch))
    counts = ", ".join(map(str, first))
    if patch <= 1:
        return f"{multiple}k+1 ({counts}, ...)"
    return (f"one of {counts}, ... ({multiple}k+1 frames whose k+1 latent frames are a "
            f"multiple of {patch})")


def resolve_frames(request: VideoRequest, defaults: VideoDefaults, facts: VideoFacts
                   ) -> tuple[int, int]:
    """(num_frames, fps): `num_frames` as given (it must keep the DiT's frame rule), else
    `seconds` x `fps` rounded up to the rule, else the recipe's frame count."""
    fps = defaults.fps if request.fps is None else request.fps
    if not 1 <= fps <= MAX_FPS:
        raise InvalidRequest("fps", f"fps must be between 1 and {MAX_FPS}, got {fps}")
    multiple, patch = facts.frame_multiple, facts.frame_patch
    if request.num_frames is not None:
        frames, field = request.num_frames, "num_frames"
        if not allows_frames(frames, multiple, patch):
            raise InvalidRequest("num_frames", f"num_frames must be {_rule(multiple, patch)} "
                                 f"for this model, got {frames}")
    elif request.seconds is not None:
        seconds, field = request.seconds, "seconds"
        if not (math.isfinite(seconds) and 0 < seconds <= MAX_SECONDS):
            raise InvalidRequest("seconds", f"seconds must be in (0, {MAX_SECONDS:g}], "
                                 f"got {seconds}")
        frames = round_up_frames(math.ceil(seconds * fps - 1e-9), multiple, patch)
    else:
        frames, field = defaults.num_frames, "num_frames"
    if facts.max_frames and frames > facts.max_frames:
        raise InvalidRequest(field, f"{field} gives {frames} frames: more than this model's "
                             f"limit of {facts.max_frames}")
    return frames, fps


def _in_range(name: str, value: float, low: float, high: float, *, open_low: bool = False
              ) -> float:
    low_ok = value > low if open_low else value >= low
    if not (math.isfinite(value) and low_ok and value <= high):
        bracket = "(" if open_low else "["
        raise InvalidRequest(name, f"{name} must be in {bracket}{low:g}, {high:g}], got {value}")
    return value


def _second_transformer(request: VideoRequest, facts: VideoFacts
                        ) -> tuple[float | None, float | None]:
    """guidance_scale_2 and boundary_ratio: only for a model with a second transformer."""
    given = [(name, value) for name, value in (("guidance_scale_2", request.guidance_scale_2),
                                               ("boundary_ratio", request.boundary_ratio))
             if value is not None]
    if given and not facts.has_second_transformer:
        raise InvalidRequest(given[0][0], f"{given[0][0]} applies only to a model with a second "
                             "(low-noise) transformer (Wan 2.2 A14B); this one has one")
    scale_2 = None if request.guidance_scale_2 is None else _in_range(
        "guidance_scale_2", request.guidance_scale_2, 0.0, facts.image.max_true_cfg_scale)
    ratio = None if request.boundary_ratio is None else _in_range(
        "boundary_ratio", request.boundary_ratio, 0.0, 1.0)
    return scale_2, ratio


def _flow_shift(request: VideoRequest, defaults: VideoDefaults, facts: VideoFacts
                ) -> float | None:
    if request.flow_shift is not None and not facts.accepts_flow_shift:
        raise InvalidRequest("flow_shift", "flow_shift does not apply to this model's scheduler")
    shift = request.flow_shift if request.flow_shift is not None else defaults.flow_shift
    if shift is None or not facts.accepts_flow_shift:
        return None
    return _in_range("flow_shift", shift, 0.0, MAX_FLOW_SHIFT, open_low=True)


def _image(request: VideoRequest, facts: VideoFacts) -> RgbImage | None:
    """The decoded input image; refused where the model takes none, required where it needs
    one (image-to-video)."""
    if request.image is None:
        if facts.max_condition_images > 0:
            raise InvalidRequest("input_reference", "this image-to-video model needs an input "
                                 "image: input_reference (a file) or image_reference (a data "
                                 "URL)")
        return None
    if facts.max_condition_images < 1 or not facts.can_encode:
        raise InvalidRequest(request.image_field, f"{request.image_field}: this model makes "
                             "videos from text only; use an image-to-video model")
    return decode_image(request.image, MAX_REFERENCE_PIXELS, request.image_field)


def resolve_video_request(request: VideoRequest, defaults: VideoDefaults,
                          facts: VideoFacts) -> VideoParams:
    """Fill the recipe's defaults and check every field against the stages' published facts
    (prompt, size, steps and seed as for an image: images/protocol.resolve_image_request)."""
    frames, fps = resolve_frames(request, defaults, facts)
    image = resolve_image_request(
        ImageRequest(prompt=request.prompt, negative_prompt=request.negative_prompt,
                     width=request.width, height=request.height,
                     num_inference_steps=request.num_inference_steps, seed=request.seed,
                     step_cache_threshold=request.step_cache_threshold, lora=request.lora,
                     preview=request.preview),
        ImageDefaults(width=defaults.width, height=defaults.height,
                      num_inference_steps=defaults.num_inference_steps, true_cfg_scale=0.0,
                      negative_prompt=defaults.negative_prompt), facts.image)
    guidance = _in_range("guidance_scale", defaults.guidance_scale if request.guidance_scale
                         is None else request.guidance_scale, 0.0, facts.image.max_true_cfg_scale)
    scale_2, ratio = _second_transformer(request, facts)
    if scale_2 is not None and scale_2 > 1 and guidance <= 1:
        raise InvalidRequest("guidance_scale_2", "guidance_scale_2 > 1 needs guidance_scale > 1 "
                             "(without it the low-noise transformer would not guide)")
    volume = frames * image.width * image.height
    if facts.max_video_pixels and volume > facts.max_video_pixels:
        raise InvalidRequest("num_frames" if request.num_frames is not None or request.seconds
                             is None else "seconds",
                             f"{frames} frames of {image.width}x{image.height} are "
                             f"{volume} pixels: more than this model's limit of "
                             f"{facts.max_video_pixels}")
    return VideoParams(
        prompt=image.prompt, negative_prompt=image.negative_prompt or "", width=image.width,
        height=image.height, num_frames=frames, fps=fps,
        num_inference_steps=image.num_inference_steps, guidance_scale=guidance, seed=image.seed,
        guidance_scale_2=scale_2, boundary_ratio=ratio,
        flow_shift=_flow_shift(request, defaults, facts),
        step_cache_threshold=image.step_cache_threshold, image=_image(request, facts),
        lora=image.lora, preview=image.preview)


# -- the OpenAI form ------------------------------------------------------------------------------


def _reference(form: Form) -> tuple[bytes | None, str]:
    """The input image: `input_reference` (one file) XOR `image_reference` (a data URL)."""
    files = form.file_list("input_reference")
    reference = form.text("image_reference")
    if files and reference is not None:
        raise InvalidRequest("image_reference", "give the input image once: input_reference (a "
                             "file) or image_reference (a data URL), not both")
    if len(files) > 1:
        raise InvalidRequest("input_reference", f"input_reference takes one image, got "
                             f"{len(files)}")
    if files:
        return files[0].data, "input_reference"
    if reference is not None:
        return image_from_reference(reference), "image_reference"
    return None, "input_reference"


def video_request(form: Form) -> VideoRequest:
    """The form's fields, typed (a bad value is a 400 naming it); limits are checked later,
    against what the stages publish (protocol.py)."""
    form.refuse_unknown(FORM_FIELDS)
    size = form.text("size")
    width, height = parse_size(size) if size else (None, None)
    image, image_field = _reference(form)
    fields = FormFields(form, blank_is_absent=True)
    return VideoRequest(
        prompt=form.text("prompt") or "", model=form.text("model") or "",
        negative_prompt=form.text("negative_prompt"), width=width, height=height,
        num_frames=fields.integer("num_frames"), seconds=fields.number("seconds"),
        fps=fields.integer("fps"), num_inference_steps=fields.integer("num_inference_steps"),
        guidance_scale=fields.number("guidance_scale"),
        guidance_scale_2=fields.number("guidance_scale_2"),
        boundary_ratio=fields.number("boundary_ratio"), flow_shift=fields.number("flow_shift"),
        seed=fields.integer("seed"), step_cache_threshold=fields.number("step_cache_threshold"),
        image=image, image_field=image_field, lora=parse_lora_text(form.text("lora")),
        preview=_preview(form, fields))


def _preview(form: Form, fields: FormFields) -> PreviewAsk | None:
    """`preview` (JSON: {"every": k, "size": px}) or the form's `preview_every`/`preview_size`."""
    text = form.text("preview")
    if text is None:
        return preview_from_form(fields)
    if fields.integer("preview_every") is not None or fields.integer("preview_size") is not None:
        raise InvalidRequest("preview", "give previews once: preview, or preview_every and "
                             "preview_size")
    try:
        value = json.loads(text)
    except ValueError:
        raise InvalidRequest("preview", 'preview must look like {"every": 1, "size": 128}'
                             ) from None
    return parse_preview(value)


def form_from_json(body: dict[str, object]) -> Form:
    """A JSON body as the form it stands for: scalars as their text, image_reference (an
    object) as its JSON. A file field cannot come in JSON."""
    form = Form()
    for name, value in body.items():
        if value is None:
            continue
        if name == "input_reference":
            raise InvalidRequest(name, "input_reference is a file: send a multipart form, or "
                                 "image_reference with a data URL")
        if isinstance(value, bool) or (isinstance(value, list) and name != "lora") or (
                isinstance(value, dict) and name not in OBJECT_FIELDS):
            raise InvalidRequest(name, f"{name} must be a string or a number")
        form.fields[name] = [value if isinstance(value, str) else json.dumps(value)]
    return form
