"""Runs the tiny-shapes grammar through any image generator and scores what comes back.

`evaluate(generate, out_dir)` is independent of how images are made: `generate(prompt, seed)`
may call the stock pipeline in-process (`pipeline_generator`) or a running mesh over REST. It
writes `metrics.json` (accuracy per attribute, confusion per attribute, every prompt's reading,
and how each attribute is measured) and `grid.png` (every image, labelled with its prompt and
any attribute the scorer read differently).

The evaluation harness tiny-shapes-edit and tiny-shapes-video share lives here too (the
training one is `harness`): `load_stock` (a stock pipeline from a folder), `generate_each` (the
loop over prompts with its progress log), `write_cells` (a grid of labelled cells) and
`eval_parser` / `start_cli` (the in-process evaluators' common command line).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import textwrap
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, TypeVar

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from stagemesh.models.tiny_shapes.data import (
    BACKGROUNDS,
    COLOURS,
    POSITIONS,
    SHAPES,
    Spec,
    all_specs,
    parse_caption,
)
from stagemesh.models.tiny_shapes.scoring import ATTRIBUTES, METHODS, Measurement, measure

if TYPE_CHECKING:
    from diffusers.pipelines.pipeline_utils import DiffusionPipeline
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

logger = logging.getLogger(__name__)
T = TypeVar("T")
P = TypeVar("P")
Pipe = TypeVar("Pipe", bound="DiffusionPipeline")

Generate = Callable[[str, int], np.ndarray]
"""generate(prompt, seed) -> uint8 RGB array (H, W, 3)."""
Draw = Callable[[Sequence[str], int], list[np.ndarray]]
"""draw(prompts, seed) -> a `Generate`'s image for each prompt, drawn in one batch."""

VALUES: dict[str, tuple[str, ...]] = {
    "colour": tuple(COLOURS),
    "shape": SHAPES,
    "position": POSITIONS,
    "background": tuple(BACKGROUNDS),
}
DEFAULT_STEPS = 16
DEFAULT_GUIDANCE = 4.0
_CELL_SCALE = 5
_LABEL_HEIGHT = 52


class Record(TypedDict):
    """One prompt's reading: attribute -> value asked for, value seen, whether they agree."""

    prompt: str
    wanted: dict[str, str]
    seen: dict[str, str]
    correct: dict[str, bool]
    fill: float
    corners: float
    taper: float


class Metrics(TypedDict):
    """What `evaluate` returns and writes to metrics.json."""

    n: int
    seed: int
    accuracy: dict[str, float]
    confusion: dict[str, dict[str, dict[str, int]]]
    methods: dict[str, str]
    records: list[Record]


# The fewest prompts in which every value of every attribute can appear.
MIN_SUBSET_PROMPTS = max(len(values) for values in VALUES.values())


def all_prompts() -> list[str]:
    """The whole grammar: 270 prompts in a fixed order."""
    return [spec.caption for spec in all_specs()]


def subset_prompts(n: int = 18) -> list[str]:
    """A stable subset of `n` prompts (n >= 6) in which every value of every attribute appears.

    Walks the grammar in a fixed pseudo-random order, first taking prompts that add an unseen
    value, then filling up to `n` in the same order; the same `n` always gives the same list.
    """
    if n < MIN_SUBSET_PROMPTS:
        raise ValueError(f"n must be at least {MIN_SUBSET_PROMPTS} to cover every value, got {n}")
    order = [all_specs()[i] for i in np.random.default_rng(20261130).permutation(270)]
    chosen: list[Spec] = []
    seen: dict[str, set[str]] = {name: set() for name in ATTRIBUTES}
    for spec in order:
        if any(getattr(spec, name) not in seen[name] for name in ATTRIBUTES):
            chosen.append(spec)
            for name in ATTRIBUTES:
                seen[name].add(getattr(spec, name))
    chosen += [spec for spec in order if spec not in chosen][: max(0, n - len(chosen))]
    return [spec.caption for spec in chosen[:n]]


def _confusion(records: list[Record], name: str) -> dict[str, dict[str, int]]:
    table = {wanted: dict.fromkeys(VALUES[name], 0) for wanted in VALUES[name]}
    for record in records:
        table[record["wanted"][name]][record["seen"][name]] += 1
    return table


def _attributes(reading: Spec | Measurement) -> dict[str, str]:
    return {name: str(getattr(reading, name)) for name in ATTRIBUTES}


def _record(prompt: str, image: np.ndarray) -> Record:
    wanted, seen = _attributes(parse_caption(prompt)), measure(image)
    seen_values = _attributes(seen)
    return {
        "prompt": prompt,
        "wanted": wanted,
        "seen": seen_values,
        "correct": {name: seen_values[name] == wanted[name] for name in ATTRIBUTES},
        "fill": round(seen.fill, 3),
        "corners": round(seen.corners, 3),
        "taper": round(seen.taper, 3),
    }


def _cell(image: np.ndarray, record: Record) -> Image.Image:
    h, w = image.shape[:2]
    cell = Image.new("RGB", (w * _CELL_SCALE, h * _CELL_SCALE + _LABEL_HEIGHT), "white")
    cell.paste(Image.fromarray(image).resize((w * _CELL_SCALE, h * _CELL_SCALE),
                                             Image.Resampling.NEAREST))
    draw = ImageDraw.Draw(cell)
    font = ImageFont.load_default()
    lines = textwrap.wrap(record["prompt"], width=w * _CELL_SCALE // 6)
    wrong = [f"{n}: {record['seen'][n]}" for n in ATTRIBUTES if not record["correct"][n]]
    y = h * _CELL_SCALE + 1
    for line in lines[:3]:
        draw.text((2, y), line, fill="black", font=font)
        y += 12
    if wrong:
        draw.text((2, y), ", ".join(wrong), fill=(200, 0, 0), font=font)
    return cell


def write_cells(cells: list[Image.Image], path: Path, columns: int) -> None:
    """Saves equal-sized cells as a grid, `columns` wide, on grey."""
    cw, ch = cells[0].size
    rows = -(-len(cells) // columns)
    grid = Image.new("RGB", (cw * min(columns, len(cells)), ch * rows), (230, 230, 230))
    for i, cell in enumerate(cells):
        grid.paste(cell, ((i % columns) * cw, (i // columns) * ch))
    grid.save(path)


def write_grid(images: list[np.ndarray], records: list[Record], path: Path, columns: int = 15
               ) -> None:
    """Saves every image (upscaled 5x) with its prompt and the attributes it got wrong in red."""
    write_cells([_cell(image, record) for image, record in zip(images, records, strict=True)],
                path, columns)


def generate_each(items: Sequence[T], generate: Callable[[T], P], what: str,
                  every: int = 30) -> Iterator[tuple[T, P]]:
    """(item, generate(item)) for each item, logging progress every `every` items."""
    for i, item in enumerate(items):
        yield item, generate(item)
        if (i + 1) % every == 0:
            logger.info("evaluated %d/%d %s", i + 1, len(items), what)


def _check_image(image: np.ndarray, prompt: str) -> np.ndarray:
    image = np.asarray(image)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"generate({prompt!r}) must return uint8 (H, W, 3), got "
                         f"{image.dtype} {image.shape}")
    return image


def evaluate(generate: Generate, out_dir: str | Path, prompts: list[str] | None = None,
             seed: int = 0) -> Metrics:
    """Generates one image per prompt (all with `seed`), scores them, writes metrics and grid.

    Returns the metrics dict that is also written to `out_dir/metrics.json`: `accuracy` (per
    attribute, 0..1), `confusion` (per attribute: wanted value -> seen value -> count), `n`,
    `seed`, `methods` (how each attribute is measured) and `records` (one per prompt).
    """
    prompts = all_prompts() if prompts is None else list(prompts)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images: list[np.ndarray] = []
    records: list[Record] = []
    for prompt, image in generate_each(
            prompts, lambda prompt: _check_image(generate(prompt, seed), prompt), "prompts"):
        images.append(image)
        records.append(_record(prompt, image))
    metrics: Metrics = {
        "n": len(prompts),
        "seed": seed,
        "accuracy": {n: float(np.mean([r["correct"][n] for r in records])) for n in ATTRIBUTES},
        "confusion": {name: _confusion(records, name) for name in ATTRIBUTES},
        "methods": METHODS,
        "records": records,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    write_grid(images, records, out / "grid.png")
    logger.info("accuracy over %d prompts: %s", len(prompts), metrics["accuracy"])
    return metrics


def pipeline_generator(folder: str | Path, *, steps: int = DEFAULT_STEPS,
                       guidance: float = DEFAULT_GUIDANCE, size: int = 32) -> Generate:
    """A `Generate` backed by the stock `diffusers.QwenImagePipeline`, loaded from `folder`.

    Guidance uses an empty negative prompt with `true_cfg_scale=guidance` (the pipeline skips
    guidance without a negative prompt); the seed drives a CPU `torch.Generator`.
    """
    return stock_generator(load_pipeline(folder), steps=steps, guidance=guidance, size=size)


def load_stock(pipeline_class: type[Pipe], folder: str | Path) -> Pipe:
    """`pipeline_class.from_pretrained(folder)` offline, its progress bar off."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pipe = pipeline_class.from_pretrained(folder, local_files_only=True)
    base: DiffusionPipeline = pipe  # (the call resolves to diffusers' untyped method here)
    base.set_progress_bar_config(disable=True)
    return pipe


def load_pipeline(folder: str | Path) -> QwenImagePipeline:
    """The stock tiny-shapes pipeline from a local folder, its progress bar off."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline

    return load_stock(QwenImagePipeline, folder)


def stock_generator(pipe: QwenImagePipeline, *, steps: int = DEFAULT_STEPS,
                    guidance: float = DEFAULT_GUIDANCE, size: int = 32) -> Generate:
    """`pipeline_generator` on a pipeline already loaded (with LoRA weights, for example)."""
    draw = stock_drawer(pipe, steps=steps, guidance=guidance, size=size)
    return lambda prompt, seed: draw([prompt], seed)[0]


def stock_drawer(pipe: QwenImagePipeline, *, steps: int = DEFAULT_STEPS,
                 guidance: float = DEFAULT_GUIDANCE, size: int = 32) -> Draw:
    """A `Draw` over a loaded pipeline: every prompt in one batched call, each with its own
    generator seeded `seed` (so each starts from the noise it would alone)."""
    import torch

    def draw(prompts: Sequence[str], seed: int) -> list[np.ndarray]:
        result = pipe(list(prompts), negative_prompt=[""] * len(prompts),
                      true_cfg_scale=guidance, height=size, width=size,
                      num_inference_steps=steps, output_type="np",
                      generator=[torch.Generator().manual_seed(seed) for _ in prompts])
        return [(image * 255.0).round().astype(np.uint8) for image in result.images]

    return draw


def eval_parser(description: str, threads: int = 1) -> argparse.ArgumentParser:
    """The in-process evaluators' common arguments: folder, out_dir, --steps, --guidance,
    --seed and --threads (torch threads, default `threads`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("folder")
    parser.add_argument("out_dir")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    parser.add_argument("--guidance", type=float, default=DEFAULT_GUIDANCE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=threads)
    return parser


def start_cli(args: argparse.Namespace) -> None:
    """Logging to stderr with timestamps, torch on `args.threads` threads."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch

    torch.set_num_threads(args.threads)


def main() -> None:
    parser = eval_parser("Score a tiny-shapes diffusers folder in-process.", threads=2)
    parser.add_argument("--subset", type=int, default=0, help="score subset_prompts(n) only")
    args = parser.parse_args()
    start_cli(args)
    generate = pipeline_generator(args.folder, steps=args.steps, guidance=args.guidance)
    prompts = subset_prompts(args.subset) if args.subset else None
    metrics = evaluate(generate, args.out_dir, prompts, seed=args.seed)
    print(json.dumps(metrics["accuracy"]))


if __name__ == "__main__":
    main()
