"""An image-edit request: what the client asked (EditRequest), and what will run (EditParams).

An edit is an image request (protocol.py: prompt, n, size, steps, guidance, seed) plus the
input image(s). `resolve_edit_request` decodes the images (PNG, JPEG or WebP; their pixel count
is checked from the header before any pixel is decoded), derives the size the model conditions
on, fills the recipe's defaults and checks every field against what the stages publish, before
any stage runs. Each refusal names its field (`image` for the input images).

Decoding is CPU work: call `resolve_edit_request` off the event loop.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt
from PIL import Image, UnidentifiedImageError

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.images.protocol import ImageParams, ImageRequest, resolve_image_request
from stagemesh.gateway.mesh.stages import EditFacts, ImageFacts
from stagemesh.gateway.recipes import ImageDefaults

#: The pixel area Qwen-Image-Edit resizes its input image to before encoding it (VAE) and
#: reading it (the text encoder): the stock QwenImageEditPipeline's `calculate_dimensions(1024 *
#: 1024, width / height)`. Its default output size is the same. A model that conditions at its
#: own area has its VAE publish it (EditFacts.condition_area); this is the area of a VAE that
#: does not say. Mirrored here because the gateway never imports torch;
#: tests/unit/test_edit_validation.py checks the rule against diffusers.
CONDITION_AREA = 1024 * 1024
#: ... with each side rounded to a multiple of this.
CONDITION_ROUNDING = 32
#: The image formats an edit accepts (PIL's names).
IMAGE_FORMATS = frozenset({"PNG", "JPEG", "WEBP"})

RgbImage = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class EditRequest:
    """An edit request as the client sent it: the image fields (ImageRequest; width and height
    None = the size derived from the input image) and the input image files."""

    image: ImageRequest
    images: tuple[bytes, ...]


@dataclass(frozen=True)
class EditParams:
    """A validated edit: the output (`image`), the decoded input images (uint8 RGB [H, W, 3])
    and the size they are encoded at (`condition_width` x `condition_height`)."""

    image: ImageParams
    inputs: tuple[RgbImage, ...]
    condition_width: int
    condition_height: int


def condition_size(width: int, height: int, area: int = CONDITION_AREA) -> tuple[int, int]:
    """The size an input image of `width` x `height` is resized to: `area` pixels at its
    aspect ratio, each side rounded to CONDITION_ROUNDING (diffusers' calculate_dimensions,
    Python's round included)."""
    ratio = width / height
    scaled_width = math.sqrt(area * ratio)
    scaled_height = scaled_width / ratio
    return (round(scaled_width / CONDITION_ROUNDING) * CONDITION_ROUNDING,
            round(scaled_height / CONDITION_ROUNDING) * CONDITION_ROUNDING)


def decode_image(data: bytes, max_pixels: int, field: str = "image") -> RgbImage:
    """PNG/JPEG/WebP bytes -> uint8 RGB [H, W, 3] (alpha dropped, palettes expanded). The size
    is read from the header and checked against `max_pixels` before the pixels are decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                if image.format not in IMAGE_FORMATS:
                    raise InvalidRequest(field, f"{field} must be a PNG, JPEG or WebP image, "
                                         f"got {image.format}")
                width, height = image.size
                if width * height > max_pixels:
                    raise InvalidRequest(field, f"{field} is {width}x{height}: more than the "
                                         f"limit of {max_pixels} pixels")
                return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (UnidentifiedImageError, Image.DecompressionBombWarning,
            Image.DecompressionBombError):
        raise InvalidRequest(field, f"{field} is not a PNG, JPEG or WebP image") from None
    except (OSError, SyntaxError, ValueError) as error:  # truncated or corrupt past the header
        raise InvalidRequest(field, f"{field} could not be decoded: {error}") from None


def _check_count(images: tuple[bytes, ...], facts: EditFacts) -> None:
    if not images:
        raise InvalidRequest("image", "image is required: the image to edit")
    if len(images) > facts.max_images:
        raise InvalidRequest("image", f"this model edits at most {facts.max_images} image"
                             f"{'s' if facts.max_images != 1 else ''} per request, got "
                             f"{len(images)}")


def _condition(first: RgbImage, facts: EditFacts) -> tuple[int, int]:
    """The size the input image is encoded at; refused (naming `image`) when the model's
    stages cannot take it (an extreme aspect ratio)."""
    height, width = first.shape[:2]
    size = condition_size(width, height, facts.condition_area or CONDITION_AREA)
    multiple, max_side = facts.encode_size_multiple, facts.encode_max_side
    if min(size) <= 0 or any(side % multiple for side in size) or (
            max_side and max(size) > max_side):
        raise InvalidRequest("image", f"image is {width}x{height}: its aspect ratio gives a "
                             f"{size[0]}x{size[1]} model input, which this model cannot take")
    return size


def default_output_size(width: int, height: int, facts: ImageFacts) -> tuple[int, int]:
    """The output size of an edit that names none: the condition size (the stock pipeline's
    default), scaled down at the same aspect ratio when it is over the DiT's published limits
    (max_pixels, max_side), each side a multiple of size_multiple."""
    scale = min(1.0, math.sqrt(facts.max_pixels / (width * height)),
                (facts.max_side or max(width, height)) / max(width, height))
    if scale >= 1.0:
        return width, height
    multiple = facts.size_multiple
    return (max(multiple, int(width * scale) // multiple * multiple),
            max(multiple, int(height * scale) // multiple * multiple))


def resolve_edit_request(request: EditRequest, defaults: ImageDefaults,
                         facts: EditFacts) -> EditParams:
    """Check the input images, then every image field (the output size defaults to the
    recipe's, else to the size derived from the first input image)."""
    _check_count(request.images, facts)
    inputs = tuple(decode_image(data, facts.max_image_pixels) for data in request.images)
    width, height = _condition(inputs[0], facts)
    if not defaults.width:
        output = default_output_size(width, height, facts.image)
        defaults = replace(defaults, width=output[0], height=output[1])
    params = resolve_image_request(request.image, defaults, facts.image)
    return EditParams(image=params, inputs=inputs, condition_width=width,
                      condition_height=height)
