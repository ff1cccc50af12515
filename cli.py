"""The `stagemesh` command line.

It parses and dispatches; each command lives in `stagemesh.commands`:

    stagemesh serve                       every stage of the recipes + the gateway
    stagemesh gateway                     only the gateway (stages run elsewhere, e.g. Kubernetes)
    stagemesh stage NAME --port P --model DIR   one stage (the Kubernetes entry point)
    stagemesh model prepare SPEC          a model's folder (a built-in one is built on first use)
    stagemesh bench NAME                  a benchmark (JSON + PNG); NAME: a module of bench/
    stagemesh train tiny-shapes[-edit]    retrain a shipped default model (image, image edit)
    stagemesh eval tiny-shapes[-edit]     measure it through a running mesh
"""

from __future__ import annotations

import argparse
import sys

from stagemesh.commands import Command
from stagemesh.commands.bench import BENCH
from stagemesh.commands.model import MODEL
from stagemesh.commands.serving import GATEWAY, SERVE
from stagemesh.commands.stage import GROUP_WORKER, STAGE
from stagemesh.commands.train import EVAL, TRAIN
from stagemesh.shared import process
from stagemesh.shared.logs import configure_logging

# Commands import huggingface_hub and transformers when they run, after this.
process.stay_offline()

#: Every command, in the order `stagemesh --help` lists them: a new one is added here.
COMMANDS: tuple[Command, ...] = (SERVE, GATEWAY, STAGE, MODEL, BENCH, TRAIN, EVAL, GROUP_WORKER)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stagemesh", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    # the choices a person is shown: not the commands whose help is suppressed (internal)
    shown = [c.name for c in COMMANDS if c.help != argparse.SUPPRESS]
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{" + ",".join(shown) + "}")
    for command in COMMANDS:
        command.add_arguments(sub.add_parser(command.name, help=command.help))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    process.die_with_parent()
    command = next(c for c in COMMANDS if c.name == args.command)
    configure_logging(command.log_name(args), args.log_level)
    command.run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
