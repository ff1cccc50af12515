"""`stagemesh serve` (every stage of the recipes + the gateway) and `stagemesh gateway` (the
gateway alone, beside stages run elsewhere)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from stagemesh.commands import Command

if TYPE_CHECKING:  # the gateway's modules load when a command runs, not when it parses
    from stagemesh.gateway.app import GatewayConfig

log = logging.getLogger(__name__)


def _add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """What serve and gateway share: recipes, listening addresses, API keys and the
    concurrency limit."""
    parser.add_argument("--recipes", help="recipe YAML (default: the embedded default mesh)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=50051)
    parser.add_argument("--api-keys-file", type=Path, default=None,
                        help="API keys, one a line (# comments), with STAGEMESH_API_KEYS; "
                             "no key configured = authentication off")
    parser.add_argument("--max-concurrent-requests", type=int, default=None,
                        help="requests running at once before 429 (default: sized from the "
                             "stages' queues)")
    parser.add_argument("--realtime-max-sessions", type=int, default=None,
                        help="GET /v1/realtime sessions open at once (default: as many as the "
                             "recipe's transcriber holds)")
    parser.add_argument("--realtime-idle-timeout", type=float, default=None, metavar="SECONDS",
                        help="close a realtime session with no client event for this long "
                             "while no answer plays (default: 120)")
    parser.add_argument("--realtime-max-buffer-seconds", type=float, default=None,
                        metavar="SECONDS",
                        help="audio a realtime client may buffer before a commit with turn "
                             "detection off (default: 600)")


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    _add_gateway_arguments(parser)
    parser.add_argument("--stage-ports", choices=["recipe", "auto"], default="recipe",
                        help="auto: put stages on free ports instead of the recipe's")
    parser.add_argument("--replicas", default=None, metavar="STAGE=N[,STAGE=N]",
                        help="run N processes of a stage (e.g. dit=2), each on a free port; "
                             "the gateway routes each request to the least-loaded one")
    parser.add_argument("--strict", action="store_true",
                        help="fail when a recipe needs an optional extra that is not installed "
                             "(default: serve the other recipes, with a warning naming it)")


def _gateway_config(args: argparse.Namespace) -> GatewayConfig:
    from stagemesh.gateway.app import GatewayConfig
    from stagemesh.gateway.realtime.protocol import RealtimeLimits

    given = {name: value for name, value in (
        ("max_sessions", args.realtime_max_sessions),
        ("idle_timeout_s", args.realtime_idle_timeout),
        ("max_buffer_seconds", args.realtime_max_buffer_seconds)) if value is not None}
    try:
        realtime = RealtimeLimits(**given)
    except ValueError as error:
        raise SystemExit(f"stagemesh {args.command}: {error}") from None
    return GatewayConfig(host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                         api_keys_file=args.api_keys_file,
                         max_concurrent_requests=args.max_concurrent_requests,
                         realtime=realtime)


def _serve(args: argparse.Namespace) -> None:
    from stagemesh.gateway.recipes import DEFAULT_RECIPES, load_recipes
    from stagemesh.serve import MissingExtra, PortInUse, parse_replicas, serve, with_free_ports
    from stagemesh.shared.tracing import setup as setup_tracing

    setup_tracing("gateway")  # traces, when OTEL_* asks for them
    recipes = load_recipes(args.recipes or DEFAULT_RECIPES)
    try:
        replicas = parse_replicas(args.replicas or "")
    except ValueError as error:
        raise SystemExit(f"stagemesh serve: {error}") from None
    unknown = sorted(set(replicas) - {s for r in recipes.values() for s in r.stages})
    if unknown:
        raise SystemExit(f"stagemesh serve: --replicas names stages no recipe has: {unknown}")
    if replicas and args.stage_ports != "auto":
        log.info("--replicas: every stage goes to free ports (as with --stage-ports auto)")
    if replicas or args.stage_ports == "auto":
        recipes = with_free_ports(recipes, replicas)
    try:
        serve(recipes, _gateway_config(args), strict=args.strict)
    except (PortInUse, MissingExtra) as error:  # one line, not a traceback
        raise SystemExit(f"stagemesh serve: {error}") from None


def _gateway(args: argparse.Namespace) -> None:
    from stagemesh.gateway.recipes import DEFAULT_RECIPES, load_recipes
    from stagemesh.serve import run_gateway_until_signal
    from stagemesh.shared import eventloop  # asyncio, or uvloop with STAGEMESH_UVLOOP=1
    from stagemesh.shared.tracing import setup as setup_tracing

    setup_tracing("gateway")
    recipes = load_recipes(args.recipes or DEFAULT_RECIPES)
    eventloop.run(run_gateway_until_signal(recipes, _gateway_config(args)))


SERVE = Command("serve", "start the stages and the gateway", _add_serve_arguments, _serve)
GATEWAY = Command("gateway", "run only the gateway (stages run elsewhere)",
                  _add_gateway_arguments, _gateway)
