"""POST /v1/images/edits: OpenAI's multipart form -> an EditRequest, read once.

OpenAI's fields (`image` files, also `image[]` as the openai SDK sends a list, `prompt`,
`model`, `n`, `size`, `response_format`, `output_format`, `user`, `stream`) plus stagemesh's
image extensions (`seed`, `num_inference_steps`, `true_cfg_scale` alias `guidance_scale`,
`negative_prompt`, `width`/`height`, `execution_mode`, `priority`, `step_cache_threshold`,
`preview_every`, `preview_size`, `lora`,
`timeout`). Only the form's
shape is checked here; limits are checked against what the stages publish when the request is
prepared (edit_protocol.py). Every refusal names its field.
"""

from __future__ import annotations

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.images.edit_protocol import EditRequest
from stagemesh.gateway.images.protocol import (
    ImageRequest,
    PreviewAsk,
    execution_mode,
    parse_size,
)
from stagemesh.gateway.wire.forms import Form, FormFields
from stagemesh.gateway.wire.requests import parse_lora_text

#: Every field the route reads; any other is a 400 naming it (a misspelt field is not ignored).
EDIT_FIELDS = frozenset({
    "image", "prompt", "model", "n", "size", "response_format", "output_format", "user",
    "stream", "seed", "num_inference_steps", "true_cfg_scale", "guidance_scale",
    "negative_prompt", "width", "height", "execution_mode", "priority", "timeout", "mask",
    "step_cache_threshold", "preview_every", "preview_size", "lora"})
#: `size` values that mean "the size derived from the input image".
AUTO_SIZES = frozenset({"auto", ""})


def _size(fields: FormFields) -> tuple[int | None, int | None]:
    """`size` ("WxH" or "auto") or `width`/`height`; both, disagreeing, is a 400 naming size."""
    size = fields.string("size")
    width, height = fields.integer("width"), fields.integer("height")
    if size is None or size.strip().lower() in AUTO_SIZES:
        return width, height
    parsed = parse_size(size)
    if (width, height) != (None, None) and (width, height) != parsed:
        raise InvalidRequest("size", f"size {size!r} conflicts with width={width}, "
                             f"height={height}; give one or the other")
    return parsed


def _check_openai_fields(form: Form, fields: FormFields) -> None:
    if form.file_list("mask") or form.fields.get("mask"):
        raise InvalidRequest("mask", "mask is not supported: the model edits the whole image "
                             "as the prompt says")
    if (fields.string("response_format") or "b64_json") != "b64_json":
        raise InvalidRequest("response_format", "only response_format 'b64_json' is supported")
    if (fields.string("output_format") or "png") != "png":
        raise InvalidRequest("output_format", "only output_format 'png' is supported")


def preview_from_form(fields: FormFields) -> PreviewAsk | None:
    """`preview_every` / `preview_size` (a form has no objects)."""
    every = fields.integer("preview_every")
    return None if every is None else PreviewAsk(every, fields.integer("preview_size"))


def edit_request(form: Form) -> tuple[EditRequest, bool]:
    """The edit form -> (the request, whether to stream SSE progress)."""
    form.refuse_unknown(set(EDIT_FIELDS))
    fields = FormFields(form)
    _check_openai_fields(form, fields)
    width, height = _size(fields)
    scale_field = "true_cfg_scale" if "true_cfg_scale" in form.fields else "guidance_scale"
    scale = fields.number(scale_field)
    image = ImageRequest(
        prompt=fields.string("prompt") or "", model=fields.string("model") or "",
        negative_prompt=fields.string("negative_prompt"), n=fields.integer("n"),
        width=width, height=height, num_inference_steps=fields.integer("num_inference_steps"),
        true_cfg_scale=scale, seed=fields.integer("seed"),
        execution_mode=execution_mode(fields.string("execution_mode")),
        priority=fields.integer("priority"),
        step_cache_threshold=fields.number("step_cache_threshold"),
        preview=preview_from_form(fields), lora=parse_lora_text(fields.string("lora")))
    images = tuple(file.data for file in form.file_list("image"))
    return EditRequest(image=image, images=images), fields.boolean("stream")
