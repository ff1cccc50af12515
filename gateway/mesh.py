"""The gateway's view of the mesh: recipes, one channel per stage, live request scopes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stagemesh.gateway.cancel import (
    CancelOutcome,
    CancelScope,
    DeadlineExceeded,
    RequestCancelled,
    ScopeRegistry,
)
from stagemesh.gateway.errors import GatewayError, InvalidRequest
from stagemesh.gateway.recipes import Recipe, StageEndpoint, Task, default_recipe
from stagemesh.gateway.stage_client import StageCallError
from stagemesh.shared.logs import request_id_var
from stagemesh.shared.proto.v1 import (
    codec_service_pb2_grpc,
    common_pb2,
    dit_service_pb2_grpc,
    gateway_service_pb2,
    talker_service_pb2_grpc,
    tokenizer_service_pb2_grpc,
    vae_service_pb2_grpc,
)
from stagemesh.shared.server import CHANNEL_OPTIONS

log = logging.getLogger(__name__)

#: Every request gets a deadline: this one when the client gives none.
DEFAULT_TIMEOUT_S = 600.0
MAX_TIMEOUT_S = 3600.0
HEALTH_TIMEOUT_S = 1.0

STUBS: dict[str, Callable[[grpc.aio.Channel], Any]] = {
    "tokenizer": tokenizer_service_pb2_grpc.TokenizerServiceStub,
    "dit": dit_service_pb2_grpc.DitServiceStub,
    "vae": vae_service_pb2_grpc.VaeServiceStub,
    "talker": talker_service_pb2_grpc.TalkerServiceStub,
    "codec": codec_service_pb2_grpc.CodecServiceStub,
}


class Mesh:
    """Recipes + channels + scopes. Open with `start()`, close with `close()`."""

    def __init__(self, recipes: dict[str, Recipe]) -> None:
        self.recipes = recipes
        self.scopes = ScopeRegistry()
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def start(self) -> None:
        for recipe in self.recipes.values():
            for endpoint in recipe.stages.values():
                if endpoint.address not in self._channels:
                    self._channels[endpoint.address] = grpc.aio.insecure_channel(
                        endpoint.address, options=CHANNEL_OPTIONS)

    async def close(self) -> None:
        await asyncio.gather(*(channel.close() for channel in self._channels.values()))
        self._channels.clear()

    def recipe(self, model: str | None, task: Task) -> Recipe:
        """The recipe a request's `model` selects (empty = the task's default)."""
        if not model:
            recipe = default_recipe(self.recipes, task)
            if recipe is None:
                raise InvalidRequest("model", f"no recipe serves {task.value}")
            return recipe
        recipe = self.recipes.get(model)
        if recipe is None:
            raise InvalidRequest("model", f"unknown model {model!r}; served: "
                                 f"{sorted(self.recipes)}")
        if recipe.task is not task:
            raise InvalidRequest("model", f"model {model!r} serves {recipe.task.value}, "
                                 f"not {task.value}")
        return recipe

    def stubs(self, recipe: Recipe) -> Callable[[str], Any]:
        def stub(stage: str) -> Any:
            return STUBS[stage](self._channels[recipe.stage(stage).address])
        return stub

    @contextlib.asynccontextmanager
    async def request_scope(self, recipe: Recipe, request_id: str | None,
                            timeout: float | None) -> AsyncIterator[CancelScope]:
        """Open a CancelScope and turn every failure inside into a GatewayError."""
        if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_S:
            raise InvalidRequest("timeout", f"timeout must be in (0, {MAX_TIMEOUT_S}] seconds")
        try:
            scope = self.scopes.open(request_id, timeout or DEFAULT_TIMEOUT_S)
        except KeyError:
            raise GatewayError(grpc.StatusCode.ALREADY_EXISTS,
                               f"request id {request_id!r} is already in use",
                               "request_id") from None
        except ValueError as error:
            raise InvalidRequest("request_id", str(error)) from None
        token = request_id_var.set(scope.request_id)
        state = common_pb2.REQUEST_STATE_FAILED
        try:
            yield scope
            state = common_pb2.REQUEST_STATE_SUCCEEDED
        except RequestCancelled as cancelled:
            raise GatewayError(grpc.StatusCode.CANCELLED,
                               f"request {scope.request_id} was cancelled "
                               f"(stage {cancelled.outcome.stage or 'none'})") from None
        except DeadlineExceeded as error:
            raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, str(error)) from None
        except StageCallError as failed:
            raise self._stage_error(recipe, failed) from None
        finally:
            scope.settle(state)
            self.scopes.close(scope)
            request_id_var.reset(token)

    @staticmethod
    def _stage_error(recipe: Recipe, failed: StageCallError) -> GatewayError:
        error = failed.error
        endpoint = recipe.stages.get(failed.stage)
        where = f"{failed.stage} stage at {endpoint.address}" if endpoint else failed.stage
        if error.code is grpc.StatusCode.UNAVAILABLE:
            message = f"{where} is unavailable: {error.message}"
        elif error.code is grpc.StatusCode.DEADLINE_EXCEEDED:
            message = f"deadline exceeded in the {where}"
        else:
            message = error.message
        return GatewayError(error.code, message, error.field_name, reason=error.reason)

    async def cancel(self, request_id: str, reason: str = "cancelled by id") -> CancelOutcome:
        scope = self.scopes.get(request_id)
        if scope is None:
            raise GatewayError(grpc.StatusCode.NOT_FOUND,
                               f"no running request with id {request_id!r}", "request_id")
        return await scope.cancel(reason)

    async def _health(self, endpoint: StageEndpoint) -> str:
        stub = health_pb2_grpc.HealthStub(self._channels[endpoint.address])
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""),
                                     timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    async def stage_infos(self) -> list[gateway_service_pb2.StageInfo]:
        pairs = [(r, e) for r in self.recipes.values() for e in r.stages.values()]
        healths = await asyncio.gather(*(self._health(e) for _, e in pairs))
        return [gateway_service_pb2.StageInfo(name=e.name, recipe=r.name, address=e.address,
                                              health=h, metrics_url=e.metrics_url)
                for (r, e), h in zip(pairs, healths, strict=True)]
