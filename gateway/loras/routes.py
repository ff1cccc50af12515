"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies; admin keys only, see
wire/auth.py ADMIN_PATHS) and GET /v1/loras (the adapters of every DiT recipe)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.loras.pipeline import list_adapters, load_adapter, unload_adapter
from stagemesh.gateway.loras.protocol import load_request, unload_request
from stagemesh.gateway.wire.requests import TEXT_BODY_BYTES, read_json_object


class LoraRoutes:
    """The LoRA admin routes, bound to the gateway core."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def load(self, request: Request) -> Response:
        update = load_request(await read_json_object(request, TEXT_BODY_BYTES))
        models = await load_adapter(self.core, update)
        return JSONResponse({"object": "lora_adapter", "lora_name": update.lora_name,
                             "status": "loaded", "models": models})

    async def unload(self, request: Request) -> Response:
        update = unload_request(await read_json_object(request, TEXT_BODY_BYTES))
        models = await unload_adapter(self.core, update)
        return JSONResponse({"object": "lora_adapter", "lora_name": update.lora_name,
                             "status": "unloaded", "models": models})

    async def list(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": await list_adapters(self.core)})
