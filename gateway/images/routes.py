"""OpenAI's image API: POST /v1/images/generations (JSON) and POST /v1/images/edits (multipart
form, see edit_forms.py); both answer JSON, or SSE progress with stream=true."""

from __future__ import annotations

import base64
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from stagemesh.gateway.core import GatewayCore, RequestContext
from stagemesh.gateway.errors import GatewayError
from stagemesh.gateway.images.edit_forms import edit_request
from stagemesh.gateway.images.pipeline import (
    GeneratedImage,
    generate_images,
    prepare_edit,
    prepare_images,
    run_edit,
)
from stagemesh.gateway.images.protocol import GENERATION_BODY_BYTES, image_request
from stagemesh.gateway.mesh.events import Done, Emit, Output, StageEvent, stream_pipeline
from stagemesh.gateway.wire.forms import read_form
from stagemesh.gateway.wire.requests import (
    JsonFields,
    openai_body,
    read_json_object,
    rest_context,
    until_disconnect,
)
from stagemesh.gateway.wire.streams import Payload, sse_response
from stagemesh.shared.proto.v1 import common_pb2

#: A prepared image request, run with an optional `emit` for progress (None: just the images).
RunImages = Callable[[Emit[GeneratedImage] | None], Awaitable[list[GeneratedImage]]]


def b64_png(image: GeneratedImage) -> str:
    return base64.b64encode(image.png).decode()


def progress_payload(item: StageEvent) -> dict[str, object]:
    """A stage's queued/progress/preempted event as an SSE payload; an event about one image
    says which (`index` and `seed`)."""
    payload: dict[str, object]
    match item.event:
        case common_pb2.Queued(position=position):
            payload = {"type": "queued", "stage": item.stage, "position": position}
        case common_pb2.Preempted(step_index=step):
            payload = {"type": "preempted", "stage": item.stage, "step": step}
        case progress:
            payload = {"type": "progress", "stage": item.stage, "step": progress.step_index,
                       "total_steps": progress.total_steps,
                       "step_seconds": progress.step_seconds,
                       "elapsed_seconds": progress.elapsed_seconds}
    if item.part is not None:
        payload |= {"index": item.part.index, "seed": item.part.seed}
    return payload


class ImageRoutes:
    """The image route, bound to the gateway core."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def generations(self, request: Request) -> Response:
        body = openai_body(await read_json_object(request, GENERATION_BODY_BYTES))
        job = await prepare_images(self.core, image_request(body))  # 400 before any stream
        context = rest_context(request, body.get("timeout"))

        def run(emit: Emit[GeneratedImage] | None) -> Awaitable[list[GeneratedImage]]:
            return generate_images(self.core, job, context, emit)

        return await self._answer(request, context, bool(JsonFields(body).boolean("stream")), run)

    async def edits(self, request: Request) -> Response:
        """The OpenAI edit form: the image(s) and the instruction; the same answers as
        generations."""
        form = await read_form(request)
        edit, stream = edit_request(form)
        job = await prepare_edit(self.core, edit)  # 400 before any stage runs
        context = rest_context(request, form.text("timeout"))

        def run(emit: Emit[GeneratedImage] | None) -> Awaitable[list[GeneratedImage]]:
            return run_edit(self.core, job, context, emit)

        return await self._answer(request, context, stream, run)

    async def _answer(self, request: Request, context: RequestContext, stream: bool,
                      run: RunImages) -> Response:
        """The images as OpenAI's JSON (the work stops if the client leaves), or as SSE."""
        if stream:
            return sse_response(_events(run, context), _error_event)
        images = await until_disconnect(request, run(None))
        return JSONResponse({"created": int(time.time()),
                             "data": [{"b64_json": b64_png(i), "revised_prompt": None,
                                       "seed": i.seed} for i in images]})



async def _events(run: RunImages, context: RequestContext) -> AsyncGenerator[Payload, None]:
    """SSE: the request id, queued/progress per stage step, each image, done (then [DONE])."""
    yield {"type": "request", "request_id": context.request_id}
    async with contextlib.aclosing(stream_pipeline(run)) as items:
        async for item in items:
            yield _image_event(item)


def _error_event(error: GatewayError) -> Payload:
    return {"type": "error", **error.body()}


def _image_event(item: StageEvent | Output[GeneratedImage] | Done[list[GeneratedImage]]
                 ) -> dict[str, object]:
    if isinstance(item, StageEvent):
        return progress_payload(item)
    if isinstance(item, Output):
        return {"type": "image", "b64_json": b64_png(item.value), "index": item.value.index,
                "seed": item.value.seed}
    return {"type": "done"}
