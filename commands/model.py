"""`stagemesh model prepare SPEC...`: model folders (a built-in one is built on first use)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from stagemesh.commands import Command


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="model_command", required=True)
    prepare = commands.add_parser(
        "prepare", help="resolve model specs (building a built-in model on first use) and "
                        "print each one's folder, one per line")
    prepare.add_argument("specs", nargs="+", metavar="spec",
                         help="model folder, or builtin:<name>")
    prepare.add_argument("--json", action="store_true",
                         help='one JSON object a line instead: {"folder": ..., "extras": '
                              '{stage: the optional extra it needs}} (what serve reads)')


def _prepare(args: argparse.Namespace) -> None:
    """Print the folder of each model spec on stdout, one line per spec as it is ready (its
    only output there; logs go to stderr); a bad spec ends the command there. With --json, a
    line also names the optional extra each stage of the folder's family needs.

    `stagemesh serve` runs this in one child process for all its specs, so that building a
    model never loads torch into the gateway's process (nor opens a model folder there), and
    torch is imported once, not once per spec.
    """
    from stagemesh.models.families import stage_extras
    from stagemesh.models.registry import resolve_model

    for spec in args.specs:
        try:
            folder = resolve_model(spec)
        except (ValueError, FileNotFoundError) as error:  # a wrong spec: say so, no traceback
            raise SystemExit(f"stagemesh model prepare: {error}") from error
        _fit_preview(folder)
        if args.json:
            extras = {stage: extra.name for stage, extra in stage_extras(folder).items()}
            sys.stdout.write(json.dumps({"folder": str(folder), "extras": extras}) + "\n")
        else:
            sys.stdout.write(f"{folder}\n")
        sys.stdout.flush()


def _fit_preview(folder: Path) -> None:
    """A folder with an image or video VAE too large to decode step previews in the DiT gets
    its latent-to-RGB projection (`vae/preview.json`) fitted once, here (`prepare_projection`)."""
    if (folder / "vae" / "config.json").is_file():  # else nothing to import torch for
        from stagemesh.services.dit.preview_fit import prepare_projection

        prepare_projection(folder)


def _run(args: argparse.Namespace) -> None:
    {"prepare": _prepare}[args.model_command](args)


MODEL = Command("model", "model folders", _add_arguments, _run)
