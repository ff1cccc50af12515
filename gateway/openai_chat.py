"""POST /v1/chat/completions with image output, as vllm-omni serves it: the image comes back
as a data URL in `choices[0].message.content[0].image_url.url`."""

from __future__ import annotations

import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.errors import GatewayError
from stagemesh.gateway.http_io import (
    ClientGone,
    error_response,
    read_json_object,
    rest_context,
    until_disconnect,
)
from stagemesh.gateway.openai_images import CLIENT_GONE_STATUS, b64_png
from stagemesh.gateway.openai_requests import chat_image_request, openai_body


class ChatRoutes:
    """The chat route, bound to the gateway core."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def completions(self, request: Request) -> Response:
        try:
            body = openai_body(await read_json_object(request))
            job = await self.core.prepare_images(chat_image_request(body))
            context = rest_context(request, body.get("timeout"))
            images = await until_disconnect(request, self.core.generate_images(job, context))
        except GatewayError as error:
            return error_response(error)
        except ClientGone:
            return Response(status_code=CLIENT_GONE_STATUS)
        content = [{"type": "image_url",
                    "image_url": {"url": f"data:image/png;base64,{b64_png(i)}"}} for i in images]
        return JSONResponse({
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model") or "",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
        })
