"""`stagemesh train MODEL` and `stagemesh eval MODEL`: train a model stagemesh ships, and
measure it through a running mesh. A model is added to TRAINERS / EVALUATORS (its options are
shared by all: name them so)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from stagemesh.commands import Command

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")


def _config(base: C, args: argparse.Namespace) -> C:
    """`base` at `--threads`, then each `--set key=value` (a field of the model's config)."""
    from stagemesh.models.tiny_shapes.harness import with_overrides

    return with_overrides(dataclasses.replace(base, threads=args.threads), args.set)


def _train_tiny_shapes(args: argparse.Namespace) -> None:
    from stagemesh.models.registry import SHIPPED_TINY_SHAPES
    from stagemesh.models.tiny_shapes.train import TrainConfig, train

    base = TrainConfig.smoke() if args.smoke else TrainConfig()
    train(Path(args.out) if args.out else SHIPPED_TINY_SHAPES, smoke=args.smoke, seed=args.seed,
          config=_config(base, args))


def _train_tiny_shapes_edit(args: argparse.Namespace) -> None:
    from stagemesh.models.registry import SHIPPED_TINY_SHAPES_EDIT
    from stagemesh.models.tiny_shapes_edit.train import EditTrainConfig, train

    base = (EditTrainConfig.smoke() if args.smoke else
            EditTrainConfig.proxy() if args.proxy else EditTrainConfig())
    train(Path(args.out) if args.out else SHIPPED_TINY_SHAPES_EDIT, seed=args.seed,
          config=_config(base, args))


def _train_tiny_shapes_lora(args: argparse.Namespace) -> None:
    from stagemesh.models.tiny_shapes import SHIPPED_DIR
    from stagemesh.models.tiny_shapes.lora import NAME, SHIPPED_LORA_DIR, LoraConfig, train_lora

    base = LoraConfig.smoke() if args.smoke else LoraConfig()
    out = Path(args.out) if args.out else SHIPPED_LORA_DIR / NAME
    train_lora(SHIPPED_DIR, out, seed=args.seed, config=_config(base, args))


def _train_tiny_shapes_video(args: argparse.Namespace) -> None:
    from stagemesh.models.registry import SHIPPED_TINY_SHAPES_VIDEO
    from stagemesh.models.tiny_shapes_video.train import VideoTrainConfig, train

    base = (VideoTrainConfig.smoke() if args.smoke else
            VideoTrainConfig.proxy() if args.proxy else VideoTrainConfig())
    train(Path(args.out) if args.out else SHIPPED_TINY_SHAPES_VIDEO, seed=args.seed,
          config=_config(base, args))


def _eval_tiny_shapes(args: argparse.Namespace) -> None:
    from stagemesh.models.tiny_shapes.mesh_eval import main as eval_main

    eval_main(args)


def _eval_tiny_shapes_edit(args: argparse.Namespace) -> None:
    from stagemesh.models.tiny_shapes_edit.mesh_eval import main as eval_main

    eval_main(args)


def _eval_tiny_shapes_video(args: argparse.Namespace) -> None:
    from stagemesh.models.tiny_shapes_video.mesh_eval import main as eval_main

    eval_main(args)


#: Model name -> what `stagemesh train NAME` / `stagemesh eval NAME` runs.
TRAINERS: dict[str, Callable[[argparse.Namespace], None]] = {
    "tiny-shapes": _train_tiny_shapes, "tiny-shapes-edit": _train_tiny_shapes_edit,
    "tiny-shapes-lora": _train_tiny_shapes_lora, "tiny-shapes-video": _train_tiny_shapes_video}
EVALUATORS: dict[str, Callable[[argparse.Namespace], None]] = {
    "tiny-shapes": _eval_tiny_shapes, "tiny-shapes-edit": _eval_tiny_shapes_edit,
    "tiny-shapes-video": _eval_tiny_shapes_video}


def _add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", choices=sorted(TRAINERS))
    parser.add_argument("--out", default=None,
                        help="output folder (default: the shipped assets/MODEL; tiny-shapes-lora: "
                             "assets/tiny-shapes-loras/night, trained on assets/tiny-shapes)")
    parser.add_argument("--smoke", action="store_true", help="the whole path in seconds")
    parser.add_argument("--proxy", action="store_true",
                        help="tiny-shapes-edit, tiny-shapes-video: the <= 10 minute config to "
                             "iterate on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is fastest on a busy 2-core machine)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="override fields of the model's training config (the value read "
                             "as JSON), e.g. --set dit_steps=2000")


def _add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", choices=sorted(EVALUATORS))
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--out", default=None, help="default: eval-results/MODEL")
    parser.add_argument("--subset", type=int, default=0,
                        help="tiny-shapes: 0 = the whole grammar")
    parser.add_argument("--per-kind", type=int, default=60,
                        help="tiny-shapes-edit: held-out edits of each kind")
    parser.add_argument("--prompts", type=int, default=0,
                        help="tiny-shapes-video: held-out prompts to ask for (0 = all 42)")
    parser.add_argument("--model-name", default=None, help="recipe to ask for (default: MODEL)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--guidance", type=float, default=None,
                        help="default: what the model's recipe serves (4; tiny-shapes-edit: 1)")
    parser.add_argument("--seed", type=int, default=0)


def _default_guidance(model: str) -> float:
    if model == "tiny-shapes-edit":
        from stagemesh.models.tiny_shapes_edit.evaluate import EDIT_GUIDANCE

        return EDIT_GUIDANCE
    from stagemesh.models.tiny_shapes.evaluate import DEFAULT_GUIDANCE

    return DEFAULT_GUIDANCE


def _run_eval(args: argparse.Namespace) -> None:
    args.out = args.out or f"eval-results/{args.model}"
    if args.guidance is None:
        args.guidance = _default_guidance(args.model)
    args.model_name = args.model_name or args.model
    EVALUATORS[args.model](args)


TRAIN = Command("train", "train a model stagemesh ships", _add_train_arguments,
                lambda args: TRAINERS[args.model](args))
EVAL = Command("eval", "evaluate a shipped model through a running mesh", _add_eval_arguments,
               _run_eval)
