"""GET /v1/models (the served recipes, in OpenAI's list shape) and GET /health."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from stagemesh.gateway.core import GatewayCore


class ModelRoutes:
    """The model list and health routes, bound to the gateway core."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "stagemesh",
             "task": recipe.task.value} for name, recipe in self.core.recipes.items()]})

    async def health(self, request: Request) -> Response:
        """The gateway and every stage's grpc.health status (503 when a stage has no serving
        replica)."""
        stages = await self.core.mesh.stage_health()
        healthy = all(health == "SERVING" for health in stages.values())
        return JSONResponse({"status": "ok" if healthy else "degraded", "stages": stages},
                            status_code=200 if healthy else 503)
