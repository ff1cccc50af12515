"""Stage ports for `stagemesh serve`: free ports (tests, side-by-side meshes, `--replicas`),
and a clear error when a port a stage needs is taken."""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from collections.abc import Iterable, Mapping

from stagemesh.gateway.recipes import Recipe, StageEndpoint, split_host_port
from stagemesh.serve.plan import StageLaunch
from stagemesh.shared.ports import free_port as free_port  # serve's, re-exported


class PortInUse(RuntimeError):
    """A port a stage of this mesh needs is taken by another process."""


def _replica_target(host: str, ports: list[int]) -> str:
    """`host:port` for one replica, an `ipv4:`/`ipv6:` list for several."""
    if len(ports) == 1:
        return f"{host}:{ports[0]}"
    ip = ipaddress.ip_address(socket.gethostbyname(host) if not _is_ip(host) else host)
    scheme, shown = ("ipv6", f"[{ip}]") if ip.version == 6 else ("ipv4", str(ip))
    return f"{scheme}:" + ",".join(f"{shown}:{port}" for port in ports)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def with_free_ports(recipes: dict[str, Recipe],
                    replicas: Mapping[str, int] | None = None) -> dict[str, Recipe]:
    """The same recipes with every stage moved to free ports (tests, side-by-side meshes), and
    with `replicas[stage]` replicas of the stages it names (each on its own free port, with
    its own metrics port)."""
    replicas = dict(replicas or {})
    moved: dict[str, StageEndpoint] = {}
    result = {}
    for name, recipe in recipes.items():
        stages = {}
        for stage, endpoint in recipe.stages.items():
            if endpoint.address not in moved:
                moved[endpoint.address] = _moved(endpoint, replicas.get(
                    stage, max(1, len(endpoint.replicas))))
            stages[stage] = moved[endpoint.address]
        result[name] = dataclasses.replace(recipe, stages=stages)
    return result


def _moved(endpoint: StageEndpoint, count: int) -> StageEndpoint:
    host = endpoint.host
    ports = [free_port(host) for _ in range(count)]
    metrics = [free_port(host) for _ in range(count)] if endpoint.metrics_port else []
    return dataclasses.replace(
        endpoint, address=_replica_target(host, ports),
        metrics_port=metrics[0] if metrics else None,
        replica_metrics_ports=tuple(metrics) if count > 1 else ())


def parse_replicas(text: str) -> dict[str, int]:
    """`dit=2,vae=2` -> {"dit": 2, "vae": 2}; ValueError naming the bad part."""
    counts: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        stage, sep, count = part.partition("=")
        if not sep or not count.isdigit() or int(count) < 1:
            raise ValueError(f"--replicas: expected STAGE=N with N >= 1, got {part!r}")
        counts[stage.strip()] = int(count)
    return counts


def _port_free(host: str, port: int) -> bool:
    """Whether a listener could bind host:port now (as a gRPC server does: SO_REUSEADDR, no
    SO_REUSEPORT, so a port another process listens on is refused)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def check_ports_free(launches: Iterable[StageLaunch]) -> None:
    """Raise PortInUse naming the stage and the port if a stage's port is taken."""
    for launch in launches:
        host, port = split_host_port(launch.address)
        ports = [("gRPC", port)]
        if launch.metrics_port:
            ports.append(("metrics", launch.metrics_port))
        for kind, number in ports:
            if not _port_free(host, number):
                raise PortInUse(f"stage {launch.name}: {kind} port {host}:{number} is already in "
                                "use (another mesh on this machine?); stop it, change the "
                                "recipe's ports, or use --stage-ports auto")
