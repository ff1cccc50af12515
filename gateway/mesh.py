"""The gateway's view of the mesh: recipes, one channel per stage address, stage health.

Channels are opened by `start()` and closed by `close()` (the gateway's lifespan does both);
nothing opens a channel lazily.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import grpc
from grpc_health.v1 import health_pb2

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.recipes import Recipe, StageEndpoint, Task, default_recipe
from stagemesh.gateway.stubs import (
    ImageStubs,
    SpeechStubs,
    codec_stub,
    dit_stub,
    talker_stub,
    tokenizer_stub,
    vae_stub,
)
from stagemesh.shared.proto.v1 import gateway_service_pb2
from stagemesh.shared.server import open_channel

HEALTH_TIMEOUT_S = 1.0
#: grpc.health.v1 Check, called by name: the stub package's HealthStub declares no methods.
_HEALTH_CHECK = "/grpc.health.v1.Health/Check"


class Mesh:
    """Recipes + channels. Open with `start()`, close with `close()`."""

    def __init__(self, recipes: Mapping[str, Recipe]) -> None:
        self.recipes = dict(recipes)
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def start(self) -> None:
        for recipe in self.recipes.values():
            for endpoint in recipe.stages.values():
                if endpoint.address not in self._channels:
                    self._channels[endpoint.address] = open_channel(endpoint.address)

    async def close(self) -> None:
        channels = list(self._channels.values())
        self._channels.clear()
        await asyncio.gather(*(channel.close() for channel in channels))

    @property
    def channels(self) -> Mapping[str, grpc.aio.Channel]:
        """The open channels by stage address."""
        return self._channels

    def channel(self, endpoint: StageEndpoint) -> grpc.aio.Channel:
        try:
            return self._channels[endpoint.address]
        except KeyError:
            raise RuntimeError(f"no open channel to {endpoint.address}: "
                               "the mesh is not started") from None

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

    def image_stubs(self, recipe: Recipe) -> ImageStubs:
        return ImageStubs(tokenizer=tokenizer_stub(self.channel(recipe.stage("tokenizer"))),
                          dit=dit_stub(self.channel(recipe.stage("dit"))),
                          vae=vae_stub(self.channel(recipe.stage("vae"))))

    def speech_stubs(self, recipe: Recipe) -> SpeechStubs:
        return SpeechStubs(talker=talker_stub(self.channel(recipe.stage("talker"))),
                           codec=codec_stub(self.channel(recipe.stage("codec"))))

    async def _health(self, endpoint: StageEndpoint) -> str:
        check = self.channel(endpoint).unary_unary(
            _HEALTH_CHECK, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        try:
            reply = await check(health_pb2.HealthCheckRequest(service=""),
                                timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return "UNREACHABLE"
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def endpoints(self) -> list[tuple[Recipe, StageEndpoint]]:
        """Every stage of every recipe, in recipe order."""
        return [(r, e) for r in self.recipes.values() for e in r.stages.values()]

    async def stage_infos(self) -> list[gateway_service_pb2.StageInfo]:
        """Every stage with its grpc.health status (device and dtype: see GatewayCore)."""
        pairs = self.endpoints()
        healths = await asyncio.gather(*(self._health(e) for _, e in pairs))
        return [gateway_service_pb2.StageInfo(name=e.name, recipe=r.name, address=e.address,
                                              health=h, metrics_url=e.metrics_url)
                for (r, e), h in zip(pairs, healths, strict=True)]
