"""The gateway's LoRA admin routes (gateway/loras/) over fake stages: POST /v1/load_lora_adapter
and /v1/unload_lora_adapter (vLLM's bodies) go to every replica of the DiTs that take runtime
updates, only with an admin key; GET /v1/loras lists what each DiT recipe serves (and the gRPC
API's LoadLora/UnloadLora/ListLoras do the same, admin keys alike). After each
change, and when a DiT refuses an adapter its Describe offered, the gateway reads the DiT's
Describe again, so a request naming an unloaded adapter is a 400 naming `lora`. A replica that
restarts gets the runtime loads back before it takes requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import pytest

from stagemesh.gateway.app import open_gateway
from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.http.app import build_rest_app
from stagemesh.gateway.mesh.balancer import ReplicaSet, ReplicaState
from stagemesh.gateway.recipes import ImageDefaults, Recipe, StageEndpoint, Task
from stagemesh.gateway.wire.auth import ApiKeys
from stagemesh.shared.errors import abort_with, parse_rpc_error
from stagemesh.shared.proto.v1 import dit_service_pb2
from stagemesh.shared.proto.v1 import gateway_service_pb2 as gw
from stagemesh.shared.server import start_server
from tests.integration.fake_stages import (
    REGISTER,
    FakeDit,
    FakeTokenizer,
    FakeVae,
    gateway_stub,
    serve_fake,
    stop_all,
)

pytestmark = pytest.mark.timeout(60)

USER, ADMIN = "sk-user-0123456789", "sk-admin-0123456789"
AS_USER = {"authorization": f"Bearer {USER}"}
AS_ADMIN = {"authorization": f"Bearer {ADMIN}"}
KEYS = ApiKeys.of([USER], admin=[ADMIN])


@dataclass
class LoraDit(FakeDit):
    """A fake DiT with runtime updates: loads any path but those starting with `refuses` (if
    set); a start naming an adapter it does not serve is INVALID_ARGUMENT naming `lora`, as a
    real one."""

    runtime: bool = True
    refuses: str = ""
    lora_names: tuple[str, ...] = ("ink",)
    loads: list[str] = field(default_factory=list)
    not_up: int = 0  # loads first answered UNAVAILABLE (a stage still starting)

    async def DescribeDit(self, request: Any, context: Any) -> Any:
        described = await super().DescribeDit(request, context)
        described.runtime_lora_updates = self.runtime
        return described

    async def LoadLoraAdapter(self, request: Any, context: Any) -> Any:
        self.loads.append(request.lora_name)
        if self.not_up:
            self.not_up -= 1
            await abort_with(context, grpc.StatusCode.UNAVAILABLE, "starting",
                             reason="UNAVAILABLE")
        if self.refuses and request.lora_path.startswith(self.refuses):
            await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, "lora_path: outside",
                             reason="INVALID_ARGUMENT", field_name="lora_path")
        added = request.lora_name not in self.lora_names
        self.lora_names = tuple(sorted({*self.lora_names, request.lora_name}))
        return dit_service_pb2.LoadLoraAdapterResponse(added=added, lora_names=self.lora_names)

    async def UnloadLoraAdapter(self, request: Any, context: Any) -> Any:
        if request.lora_name not in self.lora_names:
            await abort_with(context, grpc.StatusCode.NOT_FOUND, "lora_name: no such adapter",
                             reason="LORA_NOT_FOUND", field_name="lora_name")
        self.lora_names = tuple(n for n in self.lora_names if n != request.lora_name)
        return dit_service_pb2.UnloadLoraAdapterResponse(lora_names=self.lora_names)

    async def Denoise(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        first = await anext(requests)
        unknown = {use.name for use in first.start.lora} - set(self.lora_names)
        if unknown:
            await abort_with(context, grpc.StatusCode.INVALID_ARGUMENT, "lora: unknown adapter",
                             reason="INVALID_ARGUMENT", field_name="lora")

        async def replay() -> AsyncIterator[Any]:
            yield first
            async for message in requests:
                yield message

        async for response in super().Denoise(replay(), context):
            yield response


@dataclass
class Mesh:
    replicas: list[LoraDit]  # the two replicas of recipe `img`'s DiT
    other: LoraDit  # recipe `other`'s DiT: no runtime updates
    client: httpx.AsyncClient  # no key
    core: GatewayCore
    servers: dict[str, grpc.aio.Server]  # by fake name ("dit-b": the second replica)
    ports: dict[str, int]

    def starts(self) -> int:
        return sum(len(dit.starts) for dit in self.replicas)

    def describes(self) -> int:
        return sum(dit.describes for dit in self.replicas)


@pytest.fixture
async def mesh() -> AsyncIterator[Mesh]:
    replicas, other = [LoraDit(), LoraDit(refuses="refused/")], LoraDit(runtime=False)
    fakes = {"tokenizer": FakeTokenizer(), "vae": FakeVae(), "dit-a": replicas[0],
             "dit-b": replicas[1], "dit-other": other}
    servers, ports = {}, {}
    for name, servicer in fakes.items():
        servers[name], ports[name] = await serve_fake(name.split("-")[0], servicer)
    dits = f"ipv4:127.0.0.1:{ports['dit-a']},127.0.0.1:{ports['dit-b']}"

    def recipe(name: str, dit: str) -> Recipe:
        stages = {"tokenizer": f"127.0.0.1:{ports['tokenizer']}", "dit": dit,
                  "vae": f"127.0.0.1:{ports['vae']}"}
        return Recipe(name, Task.TEXT_TO_IMAGE, "m",
                      {n: StageEndpoint(n, address) for n, address in stages.items()},
                      ImageDefaults(width=16, height=16, num_inference_steps=2))

    recipes = {"img": recipe("img", dits),
               "other": recipe("other", f"127.0.0.1:{ports['dit-other']}")}
    try:
        async with open_gateway(recipes) as core:
            app = build_rest_app(core, KEYS)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gw") as client:
                yield Mesh(replicas, other, client, core, servers, ports)
    finally:
        await stop_all(servers)


async def _post(mesh: Mesh, path: str, body: dict[str, Any],
                headers: dict[str, str] | None = None) -> httpx.Response:
    """As the admin unless `headers` say otherwise."""
    return await mesh.client.post(path, json=body, headers=AS_ADMIN if headers is None else headers)


async def _image(mesh: Mesh, lora: str) -> httpx.Response:
    return await _post(mesh, "/v1/images/generations",
                       {"prompt": "a cat", "model": "img", "lora": [{"name": lora}]}, AS_USER)


def _param(response: httpx.Response) -> str | None:
    param: str | None = response.json()["error"]["param"]
    return param


async def test_only_admin_keys_change_adapters(mesh: Mesh) -> None:
    load = {"lora_name": "wax", "lora_path": "wax"}
    for path, body in (("/v1/load_lora_adapter", load),
                       ("/v1/unload_lora_adapter", {"lora_name": "ink"})):
        assert (await _post(mesh, path, body, {})).status_code == 401
        denied = await _post(mesh, path, body, AS_USER)
        assert denied.status_code == 403, denied.text
        assert denied.json()["error"]["type"] == "permission_error"
    assert not any(dit.loads for dit in mesh.replicas)
    listed = await mesh.client.get("/v1/loras", headers=AS_USER)  # reading is anyone's
    assert listed.status_code == 200
    assert {row["model"]: row["loras"] for row in listed.json()["data"]} == {
        "img": ["ink"], "other": ["ink"]}


async def test_load_and_unload_reach_every_replica_and_the_next_request(mesh: Mesh) -> None:
    refused = await _image(mesh, "wax")
    assert refused.status_code == 400 and _param(refused) == "lora"
    loaded = await _post(mesh, "/v1/load_lora_adapter", {"lora_name": "wax", "lora_path": "wax"})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["models"] == ["img"]  # `other`'s DiT takes no runtime updates
    assert [dit.lora_names for dit in mesh.replicas] == [("ink", "wax")] * 2
    assert mesh.other.loads == []
    assert (await _image(mesh, "wax")).status_code == 200  # Describe read again
    listed = (await mesh.client.get("/v1/loras", headers=AS_USER)).json()["data"]
    assert listed[0] == {"model": "img", "loras": ["ink", "wax"], "runtime_updates": True,
                         "max_loras": 0, "max_loras_per_request": 2, "max_lora_scale": 2.0}
    unloaded = await _post(mesh, "/v1/unload_lora_adapter", {"lora_name": "wax"})
    assert unloaded.status_code == 200, unloaded.text
    starts = mesh.starts()
    gone = await _image(mesh, "wax")
    assert gone.status_code == 400 and _param(gone) == "lora"
    assert mesh.starts() == starts, "refused before any stage ran"
    again = await _post(mesh, "/v1/unload_lora_adapter", {"lora_name": "wax"})
    assert again.status_code == 404 and _param(again) == "lora_name"


async def test_a_refused_load_is_undone_and_bad_fields_are_named(mesh: Mesh) -> None:
    bad = await _post(mesh, "/v1/load_lora_adapter",
                      {"lora_name": "evil", "lora_path": "refused/evil"})
    assert bad.status_code == 400 and _param(bad) == "lora_path"
    assert [dit.loads for dit in mesh.replicas] == [["evil"], ["evil"]]
    # the replica that took it unloads it again: replicas serve the same names
    assert [dit.lora_names for dit in mesh.replicas] == [("ink",), ("ink",)]
    for body, param in (({"lora_path": "x"}, "lora_name"), ({"lora_name": "x"}, "lora_path"),
                        ({"lora_name": "x", "lora_path": "x", "lora_int_id": 1}, "lora_int_id"),
                        ({"lora_name": "x", "lora_path": "x", "model": "other"}, "model"),
                        ({"lora_name": "x", "lora_path": "x", "model": "nope"}, "model"),
                        ({"lora_name": 3, "lora_path": "x"}, "lora_name")):
        answer = await _post(mesh, "/v1/load_lora_adapter", body)
        assert answer.status_code == 400 and _param(answer) == param, (body, answer.text)


async def test_a_dit_refusing_a_published_adapter_is_read_again(mesh: Mesh) -> None:
    assert (await _image(mesh, "ink")).status_code == 200
    for dit in mesh.replicas:  # as if both restarted without it, unseen by the gateway
        dit.lora_names = ()
    describes = mesh.describes()
    stale = await _image(mesh, "ink")
    assert stale.status_code == 400 and _param(stale) == "lora"
    starts = mesh.starts()
    fresh = await _image(mesh, "ink")
    assert fresh.status_code == 400 and _param(fresh) == "lora"
    assert mesh.describes() > describes and mesh.starts() == starts


async def _refusal(call: Any) -> tuple[grpc.StatusCode, str | None]:
    """The status code and named field of a gRPC call that must fail."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    error = parse_rpc_error(caught.value)
    return error.code, error.field_name


async def test_the_grpc_api_changes_adapters_with_admin_keys_only(mesh: Mesh) -> None:
    user, admin = tuple(AS_USER.items()), tuple(AS_ADMIN.items())
    load = gw.LoadLoraRequest(lora_name="wax", lora_path="wax")
    async with gateway_stub(mesh.core, KEYS) as stub:
        assert (await _refusal(stub.LoadLora(load, metadata=user)))[0] \
            is grpc.StatusCode.PERMISSION_DENIED
        unload = gw.UnloadLoraRequest(lora_name="ink")
        assert (await _refusal(stub.UnloadLora(unload, metadata=user)))[0] \
            is grpc.StatusCode.PERMISSION_DENIED
        assert not any(dit.loads for dit in mesh.replicas)
        loaded = await stub.LoadLora(load, metadata=admin)
        assert loaded.lora_name == "wax" and list(loaded.models) == ["img"]
        assert [dit.lora_names for dit in mesh.replicas] == [("ink", "wax")] * 2
        listed = await stub.ListLoras(gw.ListLorasRequest(), metadata=user)
        assert {r.model: list(r.loras) for r in listed.recipes} == {
            "img": ["ink", "wax"], "other": ["ink"]}
        assert listed.recipes[0].runtime_updates and listed.recipes[0].max_lora_scale == 2.0
        unloaded = await stub.UnloadLora(gw.UnloadLoraRequest(lora_name="wax", model="img"),
                                         metadata=admin)
        assert list(unloaded.models) == ["img"]
        assert [dit.lora_names for dit in mesh.replicas] == [("ink",)] * 2
        refusals = (  # (request, the field its refusal names), one after another
            (gw.LoadLoraRequest(lora_name="x"), "lora_path"),
            (gw.LoadLoraRequest(lora_path="x"), "lora_name"),
            (gw.UnloadLoraRequest(lora_name="wax"), "lora_name"),  # unloaded already
            (gw.LoadLoraRequest(lora_name="x", lora_path="refused/x"), "lora_path"))
        for request, field_name in refusals:
            rpc = stub.LoadLora if isinstance(request, gw.LoadLoraRequest) else stub.UnloadLora
            code, named = await _refusal(rpc(request, metadata=admin))
            assert named == field_name and code in (grpc.StatusCode.INVALID_ARGUMENT,
                                                    grpc.StatusCode.NOT_FOUND), (code, named)


async def _until(replicas: ReplicaSet, done: Callable[[], bool]) -> None:
    """Poll the replicas (as the gateway does every second) until `done()`."""
    async with asyncio.timeout(20):
        while not done():
            await replicas.poll()
            await asyncio.sleep(0.05)


async def _restart_second(mesh: Mesh, fresh: LoraDit) -> ReplicaState:
    """The second replica of `img`'s DiT stops (the gateway sees it gone) and `fresh`, which
    has only its `lora_dir`'s adapters, serves on its port with grpc.health, as a restarted
    stage does; the state the gateway gives it once it answers SERVING again."""
    replicas = mesh.core.mesh.replica_set(mesh.core.recipes["img"].stages["dit"])
    second = replicas.replicas[1]
    await mesh.servers["dit-b"].stop(0)
    await _until(replicas, lambda: second.state is ReplicaState.UNREACHABLE)
    served = await start_server(lambda server: REGISTER["dit"](fresh, server),
                                [dit_service_pb2.DESCRIPTOR.services_by_name["DitService"]
                                 .full_name], port=mesh.ports["dit-b"])
    mesh.servers["dit-b"], mesh.replicas[1] = served.server, fresh
    # a stage's health may say NOT_SERVING for a moment while it starts: wait that out too
    await _until(replicas, lambda: second.state not in (ReplicaState.UNREACHABLE,
                                                        ReplicaState.NOT_SERVING))
    return second.state


async def test_a_replica_that_comes_back_gets_the_runtime_loads_first(mesh: Mesh) -> None:
    loaded = await _post(mesh, "/v1/load_lora_adapter", {"lora_name": "wax", "lora_path": "wax"})
    assert loaded.status_code == 200, loaded.text
    back = LoraDit(not_up=1)
    # SERVING only once it has the adapter again: a load it could not take yet keeps it out
    # until a later poll (the first replica never answers health, so the restarted one takes
    # the next requests)
    assert await _restart_second(mesh, back) is ReplicaState.SERVING
    assert back.lora_names == ("ink", "wax") and len(back.loads) >= 2 and back.starts == []
    assert (await _image(mesh, "wax")).status_code == 200
    assert len(back.starts) == 1
    # an unloaded adapter is not put back; one the replica refuses does not keep it out
    assert (await _post(mesh, "/v1/unload_lora_adapter", {"lora_name": "wax"})).status_code == 200
    assert (await _post(mesh, "/v1/load_lora_adapter",
                        {"lora_name": "oil", "lora_path": "oil"})).status_code == 200
    refusing = LoraDit(refuses="oil")
    assert await _restart_second(mesh, refusing) is ReplicaState.SERVING
    assert set(refusing.loads) == {"oil"} and refusing.lora_names == ("ink",)
