"""`stagemesh stage NAME --port P --model DIR`: one stage service (the Kubernetes entry point,
and what `stagemesh serve` starts once per replica)."""

from __future__ import annotations

import argparse
import json
import logging
import os

from stagemesh.commands import Command
from stagemesh.shared import process

log = logging.getLogger(__name__)

STAGES = ("tokenizer", "dit", "vae", "talker", "codec", "thinker", "transcriber")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=STAGES)
    parser.add_argument("--model", required=True, help="model folder, or builtin:<name>")
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to bind (default loopback; 0.0.0.0 in a pod)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument("--options", default="{}", help="stage options as JSON")
    parser.add_argument("--threads", type=int, default=None,
                        help=f"torch CPU threads (default: ${process.THREADS_ENV}, else every "
                             "usable core for dit and talker, 1 for the light stages)")


def _run(args: argparse.Namespace) -> None:
    from stagemesh.shared.tracing import setup as setup_tracing

    setup_tracing(args.name)  # traces, when OTEL_* asks for them
    threads = process.stage_threads(args.name, args.threads)
    process.quiet_openmp_waits()
    process.keep_freed_memory()
    import torch
    from transformers.utils import logging as hf_logging

    from stagemesh.models.registry import resolve_model
    from stagemesh.services.registry import build_stage
    from stagemesh.shared import eventloop  # asyncio, or uvloop with STAGEMESH_UVLOOP=1
    from stagemesh.shared.stage_runtime import serve_stage, split_runtime_options

    torch.set_num_threads(threads)
    log.info("stage %s: torch threads: %d; usable cores: %d; OMP_WAIT_POLICY=%s", args.name,
             threads, process.usable_cores(), os.environ.get("OMP_WAIT_POLICY"))
    hf_logging.disable_progress_bar()
    try:
        runtime, options = split_runtime_options(args.name, json.loads(args.options))
        bundle = build_stage(args.name, resolve_model(args.model), options)
    except ValueError as error:  # a bad option, device or dtype: one line, not a traceback
        raise SystemExit(f"stagemesh stage: {error}") from error
    status = eventloop.run(serve_stage(bundle, host=args.host, port=args.port,
                                       metrics_port=args.metrics_port, runtime=runtime))
    process.exit_without_teardown(status)


STAGE = Command("stage", "run one stage service", _add_arguments, _run,
                log_name=lambda args: f"stage:{args.name}")


def _add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("builder", help="module:function building the rank's transformers")
    parser.add_argument("source", help="what the builder builds from (a model folder)")
    parser.add_argument("options", help="the stage's options as JSON")


def _run_worker(args: argparse.Namespace) -> None:
    from stagemesh.services.dit import parallel_worker

    raise SystemExit(parallel_worker.main([args.builder, args.source, args.options]))


#: `stagemesh dit-group-worker BUILDER SOURCE OPTIONS`: a worker rank of a DiT group
#: (services/dit/parallel.py starts it, forked from a stage launcher when it has one); not for
#: people: `--help` does not list it.
GROUP_WORKER_COMMAND = "dit-group-worker"
GROUP_WORKER = Command(GROUP_WORKER_COMMAND, argparse.SUPPRESS, _add_worker_arguments,
                       _run_worker, log_name=lambda args: "stage:dit-worker")
