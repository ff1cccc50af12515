"""What `stagemesh serve` starts: one stage process per replica of each distinct stage
address, and the `stagemesh stage ...` arguments each runs with."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from stagemesh.gateway.recipes import Recipe, StageEndpoint, TargetKind, split_host_port
from stagemesh.serve.children import stagemesh_command
from stagemesh.shared.process import stage_threads


@dataclass(frozen=True)
class StageLaunch:
    """One stage process to start: one replica of a stage."""

    endpoint: StageEndpoint
    model_dir: Path
    replica: str = ""  # its host:port; "" = the endpoint's first replica
    index: int = 0  # its position in the endpoint's replicas (its metrics port)

    @property
    def address(self) -> str:
        return self.replica or self.endpoint.replicas[0]

    @property
    def metrics_port(self) -> int | None:
        return self.endpoint.metrics_port_of(self.index)

    @property
    def threads(self) -> int:
        """Its torch threads: the replicas of a stage share the machine's cores."""
        return stage_threads(self.endpoint.name, replicas=len(self.endpoint.replicas))

    @property
    def name(self) -> str:
        """For logs: the stage, and the replica when the stage has several."""
        several = len(self.endpoint.replicas) > 1
        return f"{self.endpoint.name} ({self.address})" if several else self.endpoint.name


def plan_launches(recipes: Mapping[str, Recipe], model_dirs: Mapping[str, Path]
                  ) -> list[StageLaunch]:
    """One launch per replica of each distinct stage address, with its recipe's model folder
    from `model_dirs` (model spec -> folder, as `prepare_models` returns). A `dns:` address
    names replicas serve cannot start: ValueError."""
    launches: dict[str, StageLaunch] = {}
    for recipe in recipes.values():
        for endpoint in recipe.stages.values():
            if endpoint.target.kind is TargetKind.DNS:
                raise ValueError(f"stage {endpoint.name}: {endpoint.address} is a DNS target; "
                                 "`stagemesh serve` starts stages on this machine, so list "
                                 "their ports (ipv4:127.0.0.1:P1,127.0.0.1:P2) or use "
                                 "`stagemesh gateway` beside stages run elsewhere")
            for index, replica in enumerate(endpoint.replicas):
                if replica not in launches:
                    launches[replica] = StageLaunch(endpoint, model_dirs[recipe.model],
                                                    replica, index)
    return list(launches.values())


def stage_argv(launch: StageLaunch) -> list[str]:
    """`stage ...`, the arguments of `stagemesh` for a launch, with its torch threads chosen
    here (see `stagemesh.shared.process.stage_threads`), so that the log says what each stage
    runs with. The port comes first: a forked stage shows them as its command line, cut to the
    length of the launcher's (see `stagemesh.launcher.server`)."""
    endpoint = launch.endpoint
    host, port = split_host_port(launch.address)
    argv = ["stage", endpoint.name, "--port", str(port), "--host", host,
            "--model", str(launch.model_dir), "--options", json.dumps(endpoint.options),
            "--threads", str(launch.threads)]
    if launch.metrics_port:
        argv += ["--metrics-port", str(launch.metrics_port)]
    return argv


def stage_command(launch: StageLaunch) -> list[str]:
    """`python -m stagemesh stage ...`: how a launch runs without the launcher."""
    return stagemesh_command(*stage_argv(launch))
