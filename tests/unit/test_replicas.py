"""Replicas without a server: stage addresses as gRPC targets, the replica picker, serve's plan
of one process per replica, and the stage runtime's own options."""

from __future__ import annotations

import socket
from pathlib import Path

import grpc
import pytest

from stagemesh.gateway.mesh.balancer import Replica, ReplicaSet, ReplicaState
from stagemesh.gateway.recipes import (
    Recipe,
    RecipeError,
    StageEndpoint,
    StageTarget,
    TargetKind,
    Task,
    load_recipes,
    parse_target,
)
from stagemesh.serve import (
    PortInUse,
    check_ports_free,
    parse_replicas,
    plan_launches,
    stage_command,
    with_free_ports,
)
from stagemesh.shared.control import OWNER_METADATA_KEY, owner_from_metadata
from stagemesh.shared.server import open_channel
from stagemesh.shared.stage_runtime import DEFAULT_DRAIN_GRACE_S, split_runtime_options


@pytest.mark.parametrize(("address", "replicas"), [
    ("127.0.0.1:50062", ("127.0.0.1:50062",)),
    ("localhost:50062", ("localhost:50062",)),
    ("ipv4:127.0.0.1:50062,127.0.0.1:50072", ("127.0.0.1:50062", "127.0.0.1:50072")),
    ("ipv6:[::1]:5,[::1]:6", ("[::1]:5", "[::1]:6")),
])
def test_static_targets_list_their_replicas(address: str, replicas: tuple[str, ...]) -> None:
    assert parse_target(address) == StageTarget(TargetKind.STATIC, replicas)


@pytest.mark.parametrize("address", ["dns:///stagemesh-dit.ns.svc.cluster.local:50062",
                                     "dns:stagemesh-dit.ns.svc.cluster.local:50062"])
def test_dns_targets_are_resolved_by_the_gateway(address: str) -> None:
    assert parse_target(address) == StageTarget(
        TargetKind.DNS, dns_name="stagemesh-dit.ns.svc.cluster.local", dns_port=50062)


@pytest.mark.parametrize(("address", "match"), [
    ("dit", "not host:port"),
    ("127.0.0.1:0", "not host:port"),
    ("ipv4:dit:1", "takes IP addresses"),
    ("ipv4:10.0.0.1:1,10.0.0.1:1", "lists a replica twice"),
    ("dns://8.8.8.8/dit:1", "authority is not supported"),
])
def test_bad_targets_fail_naming_the_address(address: str, match: str) -> None:
    with pytest.raises(RecipeError, match=match):
        parse_target(address)


RECIPE = """
recipes:
  - name: img
    task: text-to-image
    model: /m
    stages:
      tokenizer: {{address: "127.0.0.1:1"}}
      dit: {{address: "ipv4:127.0.0.1:2,127.0.0.1:12", metrics_port: {metrics}}}
      vae: {{address: "127.0.0.1:3"}}
"""


def test_each_replica_gets_a_metrics_port(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE.format(metrics="9162"))
    dit = load_recipes(path)["img"].stage("dit")
    assert dit.replicas == ("127.0.0.1:2", "127.0.0.1:12")
    assert [dit.metrics_port_of(i) for i in range(2)] == [9162, 9163]  # port + index
    path.write_text(RECIPE.format(metrics="[9162, 9172]"))
    dit = load_recipes(path)["img"].stage("dit")
    assert [dit.metrics_port_of(i) for i in range(2)] == [9162, 9172]
    assert dit.metrics_url_of("127.0.0.1:12", 1) == "http://127.0.0.1:9172/metrics"
    path.write_text(RECIPE.format(metrics="[9162]"))
    with pytest.raises(RecipeError, match="1 ports for 2 replicas"):
        load_recipes(path)


def _set(*loads: int) -> ReplicaSet:
    """Replicas on ports nothing listens on (the picker only reads their channels' state)."""
    replicas = ReplicaSet("dit", "x", parse_target("127.0.0.1:1"))
    replicas.replicas = [Replica(f"127.0.0.1:{i + 1}", open_channel(f"127.0.0.1:{i + 1}"), i,
                                 in_flight=load) for i, load in enumerate(loads)]
    return replicas


async def test_the_least_loaded_replica_is_picked_and_equals_take_turns() -> None:
    replicas = _set(2, 0, 1)
    assert _address(replicas.pick()) == "127.0.0.1:2"
    replicas.replicas[1].others = 5  # other gateways keep it busy
    assert _address(replicas.pick()) == "127.0.0.1:3"
    even = _set(0, 0)
    assert [_address(even.pick()) for _ in range(4)] == ["127.0.0.1:1", "127.0.0.1:2"] * 2
    await replicas.close()
    await even.close()


async def test_draining_unreachable_failed_and_tried_replicas_get_nothing_new() -> None:
    replicas = _set(5, 0, 0, 0)
    replicas.replicas[1].state = ReplicaState.NOT_SERVING
    replicas.replicas[2].state = ReplicaState.UNREACHABLE
    assert not await replicas.connect(replicas.replicas[3], 5.0)  # nothing listens there
    assert replicas.replicas[3].channel.get_state() is grpc.ChannelConnectivity.TRANSIENT_FAILURE
    assert _address(replicas.pick()) == "127.0.0.1:1"
    assert replicas.pick(exclude=[replicas.replicas[0]]) is not None  # none routable: try one
    assert replicas.pick(exclude=replicas.replicas) is None
    await replicas.close()


async def test_a_retired_replica_is_never_picked() -> None:
    replicas = _set(3, 0)
    replicas.replicas[1].retired = True
    assert _address(replicas.pick()) == "127.0.0.1:1"
    await replicas.close()


def _address(replica: Replica | None) -> str:
    assert replica is not None
    return replica.address


def _recipe(dit: str) -> Recipe:
    return Recipe(name="img", task=Task.TEXT_TO_IMAGE, model="m", stages={
        "tokenizer": StageEndpoint("tokenizer", "127.0.0.1:1", 9161),
        "dit": StageEndpoint("dit", dit, 9162),
        "vae": StageEndpoint("vae", "127.0.0.1:3")})


def test_replicas_flag_gives_a_stage_free_ports_each_with_its_metrics_port(
        tmp_path: Path) -> None:
    moved = with_free_ports({"img": _recipe("127.0.0.1:2")}, parse_replicas("dit=2"))
    dit = moved["img"].stage("dit")
    assert dit.address.startswith("ipv4:") and len(dit.replicas) == 2
    launches = plan_launches(moved, {"m": tmp_path})
    dits = [launch for launch in launches if launch.endpoint.name == "dit"]
    assert [launch.address for launch in dits] == list(dit.replicas)
    ports = {launch.metrics_port for launch in dits}
    assert len(ports) == 2 and None not in ports
    commands = [stage_command(launch) for launch in dits]
    assert {c[c.index("--port") + 1] for c in commands} == {r.split(":")[1] for r in dit.replicas}


def test_a_listed_replica_set_starts_one_process_each_and_dns_is_refused(tmp_path: Path) -> None:
    launches = plan_launches({"img": _recipe("ipv4:127.0.0.1:2,127.0.0.1:12")}, {"m": tmp_path})
    assert [launch.address for launch in launches] == [
        "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:12", "127.0.0.1:3"]
    assert [launch.metrics_port for launch in launches] == [9161, 9162, 9163, None]
    with pytest.raises(ValueError, match="DNS target"):
        plan_launches({"img": _recipe("dns:///dit:2")}, {"m": tmp_path})


@pytest.mark.parametrize("text", ["dit", "dit=0", "dit=x"])
def test_bad_replica_counts_fail(text: str) -> None:
    with pytest.raises(ValueError, match="STAGE=N"):
        parse_replicas(text)


def test_drain_grace_is_the_runtimes_option_not_the_stages() -> None:
    runtime, rest = split_runtime_options("dit", {"drain_grace_s": 5, "max_batch": 1})
    assert (runtime.drain_grace_s, rest) == (5.0, {"max_batch": 1})
    assert split_runtime_options("dit", {})[0].drain_grace_s == DEFAULT_DRAIN_GRACE_S
    with pytest.raises(ValueError, match="drain_grace_s"):
        split_runtime_options("dit", {"drain_grace_s": "soon"})


def test_a_stage_call_names_its_owner_in_metadata() -> None:
    assert owner_from_metadata([("x-request-id", "a"), (OWNER_METADATA_KEY, "key-1")]) == "key-1"
    assert owner_from_metadata(None) == ""


def test_a_port_in_use_is_an_error_naming_the_stage_before_anything_starts(
        tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        launches = plan_launches({"img": _recipe(f"ipv4:127.0.0.1:2,127.0.0.1:{port}")},
                                 {"m": tmp_path})
        launches = [launch for launch in launches if launch.address.endswith(f":{port}")]
        with pytest.raises(PortInUse, match=rf"stage dit \(127.0.0.1:{port}\): gRPC port"):
            check_ports_free(launches)
