"""`stagemesh serve`: start every stage the recipes need (one process per replica), then the
gateway, and keep the stages running.

This process hosts the gateway, so it never imports torch, diffusers, transformers or
stagemesh.models (but the registry's tables, for `--strict`): its children do. They come from
the stage launcher (`stagemesh.launcher`), one child process that imports those once and forks
each of them, so that none imports them again (~6.5 s of CPU each; most of serve's start-up on
two cores before it). Without it
(STAGEMESH_STAGE_LAUNCHER=spawn, elsewhere than Linux, or once it is gone) each child is
`python -m stagemesh ...` and imports them itself. First one `stagemesh model prepare SPEC...`
child resolves the distinct models of the recipes (a built-in one built on first use) and
prints their folders. Then `stagemesh stage ...` — the same entry point a Kubernetes Deployment
runs — runs once per replica a stage address lists (`ipv4:h:p1,h:p2`, or `--replicas dit=2`),
and the gateway waits until each reports SERVING on grpc.health, from the process serve started
(the pid its load report gives; another process answering on the port is an error, as is a port
already in use before start).

Supervision: a stage process that exits is restarted, with a backoff (1 s, doubling up to
60 s; back to 1 s once a process has stayed up for a minute), and logged; the gateway routes
around it meanwhile and sends it traffic again once it serves. No orphans: each child gets
SIGTERM when serve dies, even by `kill -9` (Linux PR_SET_PDEATHSIG, see
`stagemesh.shared.process.die_with_parent`); a forked one when the launcher dies, which dies
with serve. Ctrl-C (SIGINT) or SIGTERM stops the gateway, then the stages, each with a grace
period, then the launcher.

One module per job: `plan` (which stage processes, with which arguments), `ports` (free ports,
ports in use), `children` (forked by the launcher, or spawned), `models` (the model folders,
prepared in a child), `supervisor` (start, wait, restart, stop); this one runs them in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from stagemesh.gateway.app import GatewayConfig, run_gateway
from stagemesh.gateway.recipes import Recipe
from stagemesh.launcher import Launcher, StartMode, start_mode
from stagemesh.serve.children import child_env
from stagemesh.serve.extras import MissingExtra, servable_recipes
from stagemesh.serve.models import builtin_extras, prepare, prepare_models
from stagemesh.serve.plan import StageLaunch, plan_launches, stage_argv, stage_command
from stagemesh.serve.ports import (
    PortInUse,
    check_ports_free,
    free_port,
    parse_replicas,
    with_free_ports,
)
from stagemesh.serve.supervisor import (
    HEALTH_CHECK_METHOD,
    Supervisor,
    spawn_stage,
    stop_processes,
    wait_serving,
)
from stagemesh.shared import eventloop
from stagemesh.shared.mesh_auth import ensure_mesh_token

__all__ = ["HEALTH_CHECK_METHOD", "MissingExtra", "PortInUse", "StageLaunch", "Supervisor",
           "check_ports_free", "free_port", "parse_replicas", "plan_launches", "prepare_models",
           "run_gateway_until_signal", "serve", "spawn_stage", "stage_argv", "stage_command",
           "stop_processes", "wait_serving", "with_free_ports"]

log = logging.getLogger(__name__)


async def run_gateway_until_signal(recipes: dict[str, Recipe], config: GatewayConfig,
                                   supervisor: Supervisor | None = None) -> None:
    """The gateway (and the supervisor, if given) until SIGINT or SIGTERM."""
    stop = asyncio.Event()

    def on_signal() -> None:
        if supervisor is not None:  # Ctrl-C reaches the stages too: none is restarted now
            supervisor.stopping = True
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    watching = asyncio.create_task(supervisor.supervise()) if supervisor else None
    try:
        await run_gateway(recipes, config, stop=stop)
    finally:
        if watching is not None:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching


def serve(recipes: dict[str, Recipe], config: GatewayConfig, strict: bool = False) -> None:
    """Prepare models, leave out the recipes whose optional extras are missing (MissingExtra
    instead when `strict`), start stages, wait for them, run the gateway (and restart stages
    that exit) until Ctrl-C, then stop."""
    if strict:  # the built-in models' extras are known unprepared: refuse before any child
        servable_recipes(recipes, builtin_extras(r.model for r in recipes.values()), strict)
    ensure_mesh_token()  # before any child starts: they inherit it through the environment
    launcher = Launcher.start(child_env()) if start_mode() is StartMode.FORK else None
    supervisor: Supervisor | None = None
    try:
        prepared = prepare((r.model for r in recipes.values()), launcher=launcher)
        recipes = servable_recipes(recipes, {spec: p.extras for spec, p in prepared.items()},
                                   strict)
        launches = plan_launches(recipes, {spec: p.folder for spec, p in prepared.items()})
        supervisor = Supervisor(launches, launcher)
        supervisor.start_all()
        eventloop.run(run_gateway_until_signal(recipes, config, supervisor))  # STAGEMESH_UVLOOP
    except KeyboardInterrupt:
        pass
    finally:
        if supervisor is not None:
            supervisor.stop()
        if launcher is not None:
            launcher.close()
