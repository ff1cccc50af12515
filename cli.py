"""The `stagemesh` command line.

    stagemesh serve                       every stage of the recipes + the gateway
    stagemesh gateway                     only the gateway (stages run elsewhere, e.g. Kubernetes)
    stagemesh stage NAME --port P --model DIR   one stage (the Kubernetes entry point)
    stagemesh model prepare SPEC          a model's folder (a built-in one is built on first use)
    stagemesh bench NAME                  a benchmark (JSON + PNG); NAME: a module of bench/
    stagemesh train tiny-shapes           retrain the shipped default image model
    stagemesh eval tiny-shapes            measure it through a running mesh
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import NoReturn

# Nothing in stagemesh may try the network: model hubs are unreachable by design.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from stagemesh.shared import eventloop  # asyncio, or uvloop with STAGEMESH_UVLOOP=1
from stagemesh.shared.logs import configure_logging

log = logging.getLogger("stagemesh")

#: The stages whose compute is most of a request's time: each gets every core this process may
#: use. The others (tokenizer, vae, codec) run short, light work on one thread, so that they
#: never take cores from a heavy stage that shares the machine.
HEAVY_STAGES = frozenset({"dit", "talker", "thinker"})
THREADS_ENV = "STAGEMESH_THREADS"
#: Set by `stagemesh serve` for its children: the pid they must not outlive.
PARENT_PID_ENV = "STAGEMESH_PARENT_PID"
#: linux/prctl.h: deliver a signal to this process when its parent dies.
PR_SET_PDEATHSIG = 1
#: malloc.h: mallopt parameters (glibc).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: A stage's malloc keeps up to this much freed memory for its next step (see
#: `keep_freed_memory`), and serves blocks up to this size from its heaps, not from mmap (32
#: MiB is glibc's largest mmap threshold).
KEPT_FREE_BYTES = 512 << 20
MMAP_THRESHOLD_BYTES = 32 << 20
#: The environment through which an operator tunes glibc's malloc (then we leave it alone).
MALLOC_TUNING_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


#: cgroup v2: a container's CPU limit, as "<quota> <period>" microseconds, or "max <period>".
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cores(cpu_max: Path | None = None) -> int:
    """The CPUs this process may use: those it may run on (its affinity mask: taskset,
    cpusets), at most its cgroup's CPU quota (a container's CPU limit), rounded up."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    cores = cores or os.cpu_count() or 1
    quota = cgroup_cpu_quota(cpu_max or CGROUP_CPU_MAX)
    return cores if quota is None else min(cores, quota)


def cgroup_cpu_quota(cpu_max: Path) -> int | None:
    """The CPU limit of this process's cgroup in whole CPUs (rounded up); None when unlimited
    or unknown."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota == "max":
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError, ZeroDivisionError):
        return None


def stage_threads(stage: str, given: int | None = None) -> int:
    """A stage's torch threads: `given` (--threads), else $STAGEMESH_THREADS, else by role
    (HEAVY_STAGES get every usable core, the others one)."""
    if given is None and os.environ.get(THREADS_ENV):
        try:
            given = int(os.environ[THREADS_ENV])
        except ValueError:
            raise SystemExit(f"{THREADS_ENV} must be a whole number of threads, "
                             f"got {os.environ[THREADS_ENV]!r}") from None
    if given is not None:
        if given < 1:
            raise SystemExit(f"torch threads must be at least 1, got {given}")
        return given
    return usable_cores() if stage in HEAVY_STAGES else 1


def quiet_openmp_waits() -> None:
    """Idle OpenMP threads sleep at once instead of spinning (call before torch is imported).

    libgomp, torch's OpenMP here, lets a thread that finished its part of a parallel region
    spin for a while before it sleeps. Stage processes share cores, so that spinning burns the
    cores another stage (or this stage's gRPC and event-loop threads) is waiting for. An
    operator's own OMP_WAIT_POLICY wins.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def keep_freed_memory() -> None:
    """Let glibc's malloc keep the memory a step frees for the next step (call before torch
    allocates).

    An engine thread allocates and frees the same activation buffers every step. By default
    glibc gives the free top of a thread's heap, and every block over its (moving) mmap
    threshold, back to the kernel, so the next step faults the same pages in again, zeroed:
    the DiT stage took ~5,000 page faults per step, ~10% of its step time (burst of 8 at
    128 px, `stagemesh bench throughput`); the same loop on a main thread took none. Fixed
    thresholds (KEPT_FREE_BYTES, MMAP_THRESHOLD_BYTES) end that. An operator's own MALLOC_*_
    or GLIBC_TUNABLES win; elsewhere than Linux this does nothing.
    """
    if not sys.platform.startswith("linux") or any(k in os.environ for k in MALLOC_TUNING_ENV):
        return
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None or not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                               and mallopt(M_TRIM_THRESHOLD, KEPT_FREE_BYTES)):
        log.warning("could not set malloc's thresholds; steps may fault their memory in again")


def _cmd_serve(args: argparse.Namespace) -> None:
    from stagemesh.gateway.app import GatewayConfig
    from stagemesh.gateway.recipes import DEFAULT_RECIPES, load_recipes
    from stagemesh.serve import PortInUse, parse_replicas, serve, with_free_ports

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
    config = GatewayConfig(host=args.host, http_port=args.http_port,
                           grpc_port=args.grpc_port, api_keys_file=args.api_keys_file,
                           max_concurrent_requests=args.max_concurrent_requests)
    try:
        serve(recipes, config)
    except PortInUse as error:  # another mesh holds a port: one line, not a traceback
        raise SystemExit(f"stagemesh serve: {error}") from None


def _cmd_gateway(args: argparse.Namespace) -> None:
    from stagemesh.gateway.app import GatewayConfig
    from stagemesh.gateway.recipes import DEFAULT_RECIPES, load_recipes
    from stagemesh.serve import run_gateway_until_signal

    recipes = load_recipes(args.recipes or DEFAULT_RECIPES)
    eventloop.run(run_gateway_until_signal(recipes, GatewayConfig(
        host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
        api_keys_file=args.api_keys_file, max_concurrent_requests=args.max_concurrent_requests)))


def _cmd_stage(args: argparse.Namespace) -> None:
    threads = stage_threads(args.name, args.threads)
    quiet_openmp_waits()
    keep_freed_memory()
    import torch
    from transformers.utils import logging as hf_logging

    from stagemesh.models.registry import resolve_model
    from stagemesh.services.registry import build_stage
    from stagemesh.shared.stage_runtime import serve_stage, split_runtime_options

    torch.set_num_threads(threads)
    log.info("stage %s: torch threads: %d; usable cores: %d; OMP_WAIT_POLICY=%s", args.name,
             threads, usable_cores(), os.environ.get("OMP_WAIT_POLICY"))
    hf_logging.disable_progress_bar()
    try:
        runtime, options = split_runtime_options(args.name, json.loads(args.options))
        bundle = build_stage(args.name, resolve_model(args.model), options)
    except ValueError as error:  # a bad option, device or dtype: one line, not a traceback
        raise SystemExit(f"stagemesh stage: {error}") from error
    status = eventloop.run(serve_stage(bundle, host=args.host, port=args.port,
                                     metrics_port=args.metrics_port, runtime=runtime))
    exit_without_teardown(status)


def exit_without_teardown(status: int) -> NoReturn:
    """Run the atexit handlers (log and trace flushes), then end the process without the
    interpreter's teardown: freeing a torch stage's modules and tensors one object at a time
    takes ~1 s of CPU, and `serve` stops every stage on the same cores at once (17 by default:
    ~10 s of its Ctrl-C on two cores). Nothing is left to write: the stage has drained."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _cmd_model_prepare(args: argparse.Namespace) -> None:
    """Print the folder of each model spec on stdout, one line per spec as it is ready (its
    only output there; logs go to stderr); a bad spec ends the command there.

    `stagemesh serve` runs this in one child process for all its specs, so that building a
    model never loads torch into the gateway's process, and torch is imported once, not once
    per spec.
    """
    from stagemesh.models.registry import resolve_model

    for spec in args.specs:
        try:
            folder = resolve_model(spec)
        except (ValueError, FileNotFoundError) as error:  # a wrong spec: say so, no traceback
            raise SystemExit(f"stagemesh model prepare: {error}") from error
        sys.stdout.write(f"{folder}\n")
        sys.stdout.flush()


def bench_names() -> list[str]:
    """Every benchmark: each module of bench/ except its shared helpers."""
    import pkgutil

    from stagemesh import bench

    return sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if m.name != "common")


def _cmd_bench(args: argparse.Namespace) -> None:
    import importlib

    bench_main = importlib.import_module(f"stagemesh.bench.{args.which}").main
    bench_main(args.rest)


def _cmd_train(args: argparse.Namespace) -> None:
    import dataclasses

    from stagemesh.models.tiny_shapes.train import TrainConfig, train

    base = TrainConfig.smoke() if args.smoke else TrainConfig()
    config = dataclasses.replace(base, threads=args.threads)
    from stagemesh.models.registry import SHIPPED_TINY_SHAPES

    train(Path(args.out) if args.out else SHIPPED_TINY_SHAPES, smoke=args.smoke, seed=args.seed,
          config=config)


def _cmd_eval(args: argparse.Namespace) -> None:
    from stagemesh.models.tiny_shapes.mesh_eval import main as eval_main

    eval_main(args)


def _add_gateway_security(parser: argparse.ArgumentParser) -> None:
    """The gateway's API keys and concurrency limit (serve and gateway share them)."""
    parser.add_argument("--api-keys-file", type=Path, default=None,
                        help="API keys, one a line (# comments), with STAGEMESH_API_KEYS; "
                             "no key configured = authentication off")
    parser.add_argument("--max-concurrent-requests", type=int, default=None,
                        help="requests running at once before 429 (default: sized from the "
                             "stages' queues)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stagemesh", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the stages and the gateway")
    serve.add_argument("--recipes", help="recipe YAML (default: the embedded default mesh)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--http-port", type=int, default=8000)
    serve.add_argument("--grpc-port", type=int, default=50051)
    serve.add_argument("--stage-ports", choices=["recipe", "auto"], default="recipe",
                       help="auto: put stages on free ports instead of the recipe's")
    serve.add_argument("--replicas", default=None, metavar="STAGE=N[,STAGE=N]",
                       help="run N processes of a stage (e.g. dit=2), each on a free port; the "
                            "gateway routes each request to the least-loaded one")
    _add_gateway_security(serve)
    serve.set_defaults(func=_cmd_serve)

    gateway = sub.add_parser("gateway", help="run only the gateway (stages run elsewhere)")
    gateway.add_argument("--recipes", help="recipe YAML (default: the embedded default mesh)")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--http-port", type=int, default=8000)
    gateway.add_argument("--grpc-port", type=int, default=50051)
    _add_gateway_security(gateway)
    gateway.set_defaults(func=_cmd_gateway)

    stage = sub.add_parser("stage", help="run one stage service")
    stage.add_argument("name", choices=["tokenizer", "dit", "vae", "talker", "codec",
                                               "thinker"])
    stage.add_argument("--model", required=True, help="model folder, or builtin:<name>")
    stage.add_argument("--host", default="127.0.0.1",
                       help="interface to bind (default loopback; 0.0.0.0 in a pod)")
    stage.add_argument("--port", type=int, required=True)
    stage.add_argument("--metrics-port", type=int, default=None)
    stage.add_argument("--options", default="{}", help="stage options as JSON")
    stage.add_argument("--threads", type=int, default=None,
                       help=f"torch CPU threads (default: ${THREADS_ENV}, else every usable "
                            "core for dit and talker, 1 for the light stages)")
    stage.set_defaults(func=_cmd_stage)

    model = sub.add_parser("model", help="model folders")
    model_commands = model.add_subparsers(dest="model_command", required=True)
    prepare = model_commands.add_parser(
        "prepare", help="resolve model specs (building a built-in model on first use) and "
                        "print each one's folder, one per line")
    prepare.add_argument("specs", nargs="+", metavar="spec",
                         help="model folder, or builtin:<name>")
    prepare.set_defaults(func=_cmd_model_prepare)

    bench = sub.add_parser("bench", help="benchmarks (not tests)")
    bench.add_argument("which", choices=bench_names())
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="options of the benchmark")
    bench.set_defaults(func=_cmd_bench)

    train = sub.add_parser("train", help="train the shipped tiny-shapes model")
    train.add_argument("model", choices=["tiny-shapes"])
    train.add_argument("--out", default=None,
                       help="output folder (default: the shipped assets/tiny-shapes)")
    train.add_argument("--smoke", action="store_true", help="the whole path in seconds")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--threads", type=int, default=1,
                       help="torch threads (1 is fastest on a busy 2-core machine)")
    train.set_defaults(func=_cmd_train)

    evaluate = sub.add_parser("eval", help="evaluate tiny-shapes through a running mesh")
    evaluate.add_argument("model", choices=["tiny-shapes"])
    evaluate.add_argument("--url", default="http://127.0.0.1:8000")
    evaluate.add_argument("--out", default="eval-results/tiny-shapes")
    evaluate.add_argument("--subset", type=int, default=0, help="0 = the whole grammar")
    evaluate.add_argument("--model-name", default="tiny-shapes", help="recipe to ask for")
    evaluate.add_argument("--steps", type=int, default=16)
    evaluate.add_argument("--guidance", type=float, default=4.0)
    evaluate.add_argument("--seed", type=int, default=0)
    evaluate.set_defaults(func=_cmd_eval)
    return parser


def die_with_parent() -> None:
    """When `stagemesh serve` started this process ($STAGEMESH_PARENT_PID), ask Linux to send
    it SIGTERM when serve dies, even by `kill -9` (prctl PR_SET_PDEATHSIG), so that no stage
    outlives its supervisor holding its port. If serve is already gone, stop now. Elsewhere
    than Linux this does nothing (serve still stops its children when it exits normally)."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d)", ctypes.get_errno())
    if str(os.getppid()) != parent:  # serve died before the prctl took effect
        raise SystemExit(f"stagemesh: parent process {parent} is gone")


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    die_with_parent()
    configure_logging(args.command if args.command != "stage" else f"stage:{args.name}",
                      args.log_level)
    if args.command in ("serve", "gateway", "stage"):  # traces, when OTEL_* asks for them
        from stagemesh.shared.tracing import setup as setup_tracing
        setup_tracing(args.name if args.command == "stage" else "gateway")
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
