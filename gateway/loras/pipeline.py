"""Runtime LoRA updates over the mesh, and what each DiT serves.

A load or unload goes to every replica of each DiT it concerns (the named recipe's, or every
DiT that publishes `runtime_lora_updates`); each DiT's Describe is read again afterwards, so
the next request is checked against the new names. A load that fails on one replica is undone
on those where it took (replicas of one stage must serve the same names); an unload is done
where a replica knows the name. The gateway remembers what it loaded, per DiT address, and puts
it back on a replica that serves again after a restart (gateway/mesh/runtime_loras.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import grpc

from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.errors import GatewayError, InvalidRequest, StageUnavailable
from stagemesh.gateway.loras.protocol import LoraUpdate
from stagemesh.gateway.mesh.balancer import Replica
from stagemesh.gateway.mesh.runtime_loras import UPDATE_TIMEOUT_S
from stagemesh.gateway.mesh.stubs import dit_stub
from stagemesh.gateway.recipes import Recipe, StageEndpoint
from stagemesh.shared.errors import parse_rpc_error
from stagemesh.shared.proto.v1 import dit_service_pb2 as pb

if TYPE_CHECKING:  # the async stub class exists only in the generated .pyi file
    from stagemesh.shared.proto.v1.dit_service_pb2_grpc import DitServiceAsyncStub

T = TypeVar("T")

#: Where a refusal names the recipe.
MODEL_FIELD = "model"


@dataclass(frozen=True)
class DitService:
    """One DiT stage address and the recipes it serves."""

    endpoint: StageEndpoint
    models: tuple[str, ...]


@dataclass(frozen=True)
class _Call:
    service: DitService
    replica: Replica


def dit_recipes(core: GatewayCore) -> list[Recipe]:
    return [recipe for recipe in core.recipes.values() if "dit" in recipe.stages]


async def _services(core: GatewayCore, model: str | None) -> list[DitService]:
    """The DiTs an update goes to: the recipe's (it must take runtime updates), or every one
    that does."""
    if model is not None:
        recipe = core.recipes.get(model)
        if recipe is None or "dit" not in recipe.stages:
            raise InvalidRequest(MODEL_FIELD, f"model {model!r} has no DiT stage; DiT models: "
                                              f"{sorted(r.name for r in dit_recipes(core))}")
        candidates = [recipe]
    else:
        candidates = dit_recipes(core)
    facts = await asyncio.gather(*(core.catalog.read(core.catalog.dit, r) for r in candidates))
    chosen = [r for r, f in zip(candidates, facts, strict=True) if f.runtime_lora_updates]
    if not chosen:
        where = f"the DiT of model {model!r} does" if model else "no DiT of this mesh does"
        raise InvalidRequest(MODEL_FIELD, f"{where} not load LoRA adapters at run time (DiT "
                                          "option runtime_lora_updates)")
    by_address: dict[str, list[Recipe]] = {}
    for recipe in chosen:
        by_address.setdefault(recipe.stages["dit"].address, []).append(recipe)
    return [DitService(recipes[0].stages["dit"], tuple(r.name for r in recipes))
            for recipes in by_address.values()]


def _calls(core: GatewayCore, services: Sequence[DitService]) -> list[_Call]:
    return [_Call(service, replica) for service in services
            for replica in core.mesh.replica_set(service.endpoint).replicas
            if not replica.retired]


def _forget(core: GatewayCore, services: Sequence[DitService]) -> None:
    for service in services:
        core.catalog.drop(service.endpoint.address)


def _models(services: Sequence[DitService]) -> list[str]:
    return sorted(model for service in services for model in service.models)


def _replica_error(call: _Call, failure: grpc.aio.AioRpcError) -> GatewayError:
    error = parse_rpc_error(failure)
    if error.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return StageUnavailable(f"dit stage at {call.replica.address} is unavailable: "
                                f"{error.message}")
    return GatewayError.from_stage(error)


async def _fan_out(calls: Sequence[_Call], rpc: Callable[[DitServiceAsyncStub], Awaitable[T]]
                   ) -> list[T | grpc.aio.AioRpcError]:
    """`rpc` on every replica at once: each one's answer, or its failure."""
    answers = await asyncio.gather(*(rpc(dit_stub(call.replica.channel)) for call in calls),
                                   return_exceptions=True)
    results: list[T | grpc.aio.AioRpcError] = []
    for answer in answers:
        if isinstance(answer, BaseException) and not isinstance(answer, grpc.aio.AioRpcError):
            raise answer
        results.append(answer)
    return results


def _unload(name: str) -> Callable[[DitServiceAsyncStub], Awaitable[pb.UnloadLoraAdapterResponse]]:
    request = pb.UnloadLoraAdapterRequest(lora_name=name)
    return lambda stub: stub.UnloadLoraAdapter(request, timeout=UPDATE_TIMEOUT_S)


async def load_adapter(core: GatewayCore, update: LoraUpdate) -> list[str]:
    """Load on every replica of the DiTs concerned; the models whose DiT now serves it."""
    services = await _services(core, update.model)
    request = pb.LoadLoraAdapterRequest(lora_name=update.lora_name, lora_path=update.lora_path)
    async with core.loras.lock:  # a replica's restore waits: it then loads this one too
        calls = _calls(core, services)
        try:
            answers = await _fan_out(
                calls, lambda stub: stub.LoadLoraAdapter(request, timeout=UPDATE_TIMEOUT_S))
            failed = [(c, a) for c, a in zip(calls, answers, strict=True)
                      if isinstance(a, grpc.aio.AioRpcError)]
            if failed:
                took = [c for c, a in zip(calls, answers, strict=True)
                        if isinstance(a, pb.LoadLoraAdapterResponse) and a.added]
                await _fan_out(took, _unload(update.lora_name))  # best effort: errors pass
                raise _replica_error(*failed[0])
            for service in services:
                core.loras.remember(service.endpoint.address, update.lora_name,
                                    update.lora_path)
        finally:
            _forget(core, services)
    return _models(services)


async def unload_adapter(core: GatewayCore, update: LoraUpdate) -> list[str]:
    """Unload on every replica of the DiTs concerned that knows the name (NOT_FOUND when
    none does); the models whose DiT served it."""
    services = await _services(core, update.model)
    async with core.loras.lock:  # no restore puts it back meanwhile
        for service in services:
            core.loras.forget(service.endpoint.address, update.lora_name)
        calls = _calls(core, services)
        try:
            answers = await _fan_out(calls, _unload(update.lora_name))
        finally:
            _forget(core, services)
    failed = [(c, a) for c, a in zip(calls, answers, strict=True)
              if isinstance(a, grpc.aio.AioRpcError)]
    missing = [(c, a) for c, a in failed if a.code() is grpc.StatusCode.NOT_FOUND]
    if failed and len(missing) == len(calls):
        raise _replica_error(*missing[0])
    others = [(c, a) for c, a in failed if a.code() is not grpc.StatusCode.NOT_FOUND]
    if others:
        raise _replica_error(*others[0])
    found = {c.service.endpoint.address for c, a in zip(calls, answers, strict=True)
             if isinstance(a, pb.UnloadLoraAdapterResponse)}
    return _models([s for s in services if s.endpoint.address in found])


async def list_adapters(core: GatewayCore) -> list[dict[str, object]]:
    """What each DiT recipe serves, as its DiT publishes it."""
    recipes = dit_recipes(core)
    facts = await asyncio.gather(*(core.catalog.read(core.catalog.dit, r) for r in recipes))
    return [{"model": recipe.name, "loras": list(dit.lora_names),
             "runtime_updates": dit.runtime_lora_updates, "max_loras": dit.max_loras,
             "max_loras_per_request": dit.max_loras_per_request,
             "max_lora_scale": dit.max_lora_scale}
            for recipe, dit in zip(recipes, facts, strict=True)]
