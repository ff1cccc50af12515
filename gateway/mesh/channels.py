"""The gateway's view of the mesh: recipes, the replicas of every stage address, stage health,
and cancel by id across every replica.

A stage address is a gRPC target that may name several replicas (see `recipes.parse_target`);
each distinct address gets one ReplicaSet (gateway/balancer.py), which opens one channel per
replica and picks the replica each stage call goes to. `start()` opens them and `close()`
closes them (the gateway's lifespan does both); nothing opens a channel lazily.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.gateway.mesh.balancer import (
    HEALTH_CHECK,
    OnChange,
    Replica,
    ReplicaChannel,
    ReplicaSet,
)
from stagemesh.gateway.mesh.stubs import (
    ImageStubs,
    SpeechStubs,
    codec_stub,
    dit_stub,
    talker_stub,
    tokenizer_stub,
    vae_stub,
)
from stagemesh.gateway.recipes import Recipe, StageEndpoint, TargetKind, Task, default_recipe
from stagemesh.shared.proto.v1 import (
    control_service_pb2,
    control_service_pb2_grpc,
    gateway_service_pb2,
)

HEALTH_TIMEOUT_S = 1.0
#: How long a cancel fanned out to the replicas waits for their answers (a replica holding the
#: request answers once its state is freed).
CANCEL_FANOUT_TIMEOUT_S = 12.0


@dataclass(frozen=True)
class StageCancel:
    """One replica's answer to a cancel by id."""

    stage: str
    replica: str
    reply: control_service_pb2.CancelStageRequestResponse


class Mesh:
    """Recipes + the replicas of their stages. Open with `start()`, close with `close()`."""

    def __init__(self, recipes: Mapping[str, Recipe]) -> None:
        self.recipes = dict(recipes)
        self._sets: dict[str, ReplicaSet] = {}
        self._channels: dict[str, ReplicaChannel] = {}

    async def start(self) -> None:
        for _, endpoint in self.endpoints():
            if endpoint.address not in self._sets:
                replicas = ReplicaSet(endpoint.name, endpoint.address, endpoint.target)
                self._sets[endpoint.address] = replicas
                self._channels[endpoint.address] = ReplicaChannel(replicas)
                await replicas.start()

    async def close(self) -> None:
        sets = list(self._sets.values())
        self._sets.clear()
        self._channels.clear()
        await asyncio.gather(*(replicas.close() for replicas in sets))

    def on_change(self, callback: OnChange) -> None:
        """`callback(address)` whenever what answers at a stage address may have changed."""
        for replicas in self._sets.values():
            replicas.on_change(callback)

    @property
    def channels(self) -> Mapping[str, grpc.aio.Channel]:
        """A channel per stage address, over its replicas (see balancer.ReplicaChannel)."""
        return self._channels

    def replica_set(self, endpoint: StageEndpoint) -> ReplicaSet:
        try:
            return self._sets[endpoint.address]
        except KeyError:
            raise RuntimeError(f"no replicas open for {endpoint.address}: "
                               "the mesh is not started") from None

    def channel(self, endpoint: StageEndpoint) -> grpc.aio.Channel:
        self.replica_set(endpoint)  # raises when not started
        return self._channels[endpoint.address]

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

    def endpoints(self) -> list[tuple[Recipe, StageEndpoint]]:
        """Every stage of every recipe, in recipe order."""
        return [(r, e) for r in self.recipes.values() for e in r.stages.values()]

    async def stage_infos(self) -> list[gateway_service_pb2.StageInfo]:
        """Every replica of every stage with its grpc.health status (device and dtype: see
        GatewayCore); a stage of one replica is one row, as before replicas."""
        rows = [(r, e, replica) for r, e in self.endpoints()
                for replica in self.replica_set(e).replicas if not replica.retired]
        healths = await asyncio.gather(*(_health(replica) for _, _, replica in rows))
        return [gateway_service_pb2.StageInfo(
                    name=e.name, recipe=r.name, address=replica.address, health=health,
                    metrics_url=_metrics_url(e, replica))
                for (r, e, replica), health in zip(rows, healths, strict=True)]

    async def stage_health(self) -> dict[str, str]:
        """`recipe/stage` -> SERVING when any replica of the stage serves, else what its
        first replica reports (a stage is up while one replica is)."""
        replicas: dict[str, list[str]] = {}
        for info in await self.stage_infos():
            replicas.setdefault(f"{info.recipe}/{info.name}", []).append(info.health)
        return {key: "SERVING" if "SERVING" in states else next(iter(states), "NO_REPLICA")
                for key, states in ((f"{r.name}/{e.name}", replicas.get(f"{r.name}/{e.name}", []))
                                    for r, e in self.endpoints())}

    def row_endpoints(self) -> list[StageEndpoint]:
        """The endpoint of each row `stage_infos` returns, in the same order."""
        return [e for r, e in self.endpoints()
                for replica in self.replica_set(e).replicas if not replica.retired]

    async def cancel_everywhere(self, request_id: str, reason: str,
                                owner: str) -> list[StageCancel]:
        """Send a cancel by id to every replica of every stage (for a request this gateway
        does not run); the replies, in recipe stage order. A replica that cannot be reached
        in time is left out."""
        targets = [(replicas.stage, replica) for replicas in self._sets.values()
                   for replica in replicas.replicas if not replica.retired]
        request = control_service_pb2.CancelStageRequestRequest(
            request_id=request_id, reason=reason, owner=owner)
        replies = await asyncio.gather(
            *(control_service_pb2_grpc.StageControlServiceStub(replica.channel)
              .CancelStageRequest(request, timeout=CANCEL_FANOUT_TIMEOUT_S)
              for _, replica in targets), return_exceptions=True)
        return [StageCancel(stage, replica.address, reply)
                for (stage, replica), reply in zip(targets, replies, strict=True)
                if isinstance(reply, control_service_pb2.CancelStageRequestResponse)]


def _metrics_url(endpoint: StageEndpoint, replica: Replica) -> str:
    """A replica's /metrics: a listed replica's own port; a DNS-resolved one (a pod) serves on
    the stage's metrics port."""
    index = 0 if endpoint.target.kind is TargetKind.DNS else replica.index
    return endpoint.metrics_url_of(replica.address, index)


async def _health(replica: Replica) -> str:
    check = replica.channel.unary_unary(
        HEALTH_CHECK, request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString)
    try:
        reply = await check(health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S)
    except grpc.aio.AioRpcError:
        return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
