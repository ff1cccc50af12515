"""`stagemesh train MODEL` and `stagemesh eval MODEL`: train a shipped model, and measure it
through a running mesh."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from stagemesh.commands import Command


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", choices=["tiny-shapes"])
    parser.add_argument("--out", default=None,
                        help="output folder (default: the shipped assets/tiny-shapes)")
    parser.add_argument("--smoke", action="store_true", help="the whole path in seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is fastest on a busy 2-core machine)")


def _train(args: argparse.Namespace) -> None:
    from stagemesh.models.registry import SHIPPED_TINY_SHAPES
    from stagemesh.models.tiny_shapes.train import TrainConfig, train

    base = TrainConfig.smoke() if args.smoke else TrainConfig()
    config = dataclasses.replace(base, threads=args.threads)
    train(Path(args.out) if args.out else SHIPPED_TINY_SHAPES, smoke=args.smoke, seed=args.seed,
          config=config)


def _add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", choices=["tiny-shapes"])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--out", default="eval-results/tiny-shapes")
    parser.add_argument("--subset", type=int, default=0, help="0 = the whole grammar")
    parser.add_argument("--model-name", default="tiny-shapes", help="recipe to ask for")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--guidance", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)


def _eval(args: argparse.Namespace) -> None:
    from stagemesh.models.tiny_shapes.mesh_eval import main as eval_main

    eval_main(args)


TRAIN = Command("train", "train the shipped tiny-shapes model", _add_train_arguments, _train)
EVAL = Command("eval", "evaluate tiny-shapes through a running mesh", _add_eval_arguments, _eval)
