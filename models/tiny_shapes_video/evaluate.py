"""Runs the held-out prompts through any video generator, judges each clip, writes metrics and
a strip per clip.

`evaluate(generate, out_dir)` is independent of how clips are made: `generate(prompt, seed)` may
call the stock `WanPipeline` in-process (`pipeline_generator`) or a running mesh over REST
(`mesh_eval`). It writes metrics.json (each verdict's accuracy, every clip's per-frame reading
and centroid travel) and strips.png (every clip's frames left to right, failures in red).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from stagemesh.models.tiny_shapes.evaluate import (
    DEFAULT_GUIDANCE,
    DEFAULT_STEPS,
    eval_parser,
    generate_each,
    load_stock,
    start_cli,
    write_cells,
)
from stagemesh.models.tiny_shapes_video.data import (
    NUM_FRAMES,
    PROMPT_TOKENS,
    parse_clip_caption,
    split,
)
from stagemesh.models.tiny_shapes_video.judge import VERDICTS, judge_measurement, measure_clip

logger = logging.getLogger(__name__)

VideoGenerate = Callable[[str, int], np.ndarray]
"""generate(prompt, seed) -> uint8 RGB clip (frames, H, W, 3)."""

_SCALE = 3


class ClipRecord(TypedDict):
    prompt: str
    colours: list[str]
    shapes: list[str]
    travel: list[float]
    motion: str
    verdict: dict[str, bool]


class VideoMetrics(TypedDict):
    n: int
    seed: int
    accuracy: dict[str, float]
    records: list[ClipRecord]


def held_out_prompts(n: int = 0) -> list[str]:
    """The held-out prompts (all of them when n is 0, else a stable sample of n)."""
    prompts = [spec.caption for spec in split()[1]]
    if n:
        prompts = [prompts[i] for i in np.random.default_rng(0).permutation(len(prompts))[:n]]
    return prompts


def _strip(clip: np.ndarray, record: ClipRecord) -> Image.Image:
    h, w = clip.shape[1] * _SCALE, clip.shape[2] * _SCALE
    cell = Image.new("RGB", (len(clip) * (w + 2), h + 28), "white")
    for i, frame in enumerate(clip):
        cell.paste(Image.fromarray(frame).resize((w, h), Image.Resampling.NEAREST),
                   (i * (w + 2), 0))
    draw = ImageDraw.Draw(cell)
    font = ImageFont.load_default()
    ok = record["verdict"]["correct"]
    draw.text((2, h + 2), record["prompt"], fill="black" if ok else (200, 0, 0), font=font)
    if not ok:
        wrong = [v for v in VERDICTS[:2] if not record["verdict"][v]]
        draw.text((2, h + 14), f"not {', not '.join(wrong)} (seen {record['motion']})",
                  fill=(200, 0, 0), font=font)
    return cell


def _record(prompt: str, clip: np.ndarray) -> ClipRecord:
    seen = measure_clip(clip)
    return {"prompt": prompt, "colours": list(seen.colours), "shapes": list(seen.shapes),
            "travel": [round(t, 2) for t in seen.travel], "motion": seen.motion,
            "verdict": judge_measurement(parse_clip_caption(prompt), seen)}


def evaluate(generate: VideoGenerate, out_dir: str | Path, prompts: list[str] | None = None,
             seed: int = 0) -> VideoMetrics:
    """Generates each prompt (held-out by default) at `seed`, judges it; writes metrics.json
    and strips.png to `out_dir`."""
    prompts = held_out_prompts() if prompts is None else prompts
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records: list[ClipRecord] = []
    cells: list[Image.Image] = []
    for prompt, clip in generate_each(prompts, lambda prompt: np.asarray(generate(prompt, seed)),
                                      "clips", every=10):
        record = _record(prompt, clip)
        records.append(record)
        cells.append(_strip(clip, record))
    accuracy = {v: float(np.mean([r["verdict"][v] for r in records])) for v in VERDICTS}
    metrics: VideoMetrics = {"n": len(records), "seed": seed, "accuracy": accuracy,
                             "records": records}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    write_cells(cells, out / "strips.png", columns=1)
    logger.info("accuracy over %d prompts: %s", len(records), accuracy)
    return metrics


def pipeline_generator(folder: str | Path, *, steps: int = DEFAULT_STEPS,
                       guidance: float = DEFAULT_GUIDANCE, frames: int = NUM_FRAMES
                       ) -> VideoGenerate:
    """A `VideoGenerate` backed by the stock `WanPipeline` loaded from `folder`, reading the
    prompt at the model's PROMPT_TOKENS (as the recipe's tokenizer does)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from diffusers.pipelines.wan.pipeline_wan import WanPipeline

    from stagemesh.models.tiny_shapes.data import IMAGE_SIZE

    pipe = load_stock(WanPipeline, folder)

    def generate(prompt: str, seed: int) -> np.ndarray:
        result = pipe(prompt=prompt, negative_prompt="", height=IMAGE_SIZE, width=IMAGE_SIZE,
                      num_frames=frames, num_inference_steps=steps, guidance_scale=guidance,
                      max_sequence_length=PROMPT_TOKENS, output_type="np",
                      generator=torch.Generator().manual_seed(seed))
        clip: np.ndarray = (np.asarray(result.frames[0]) * 255.0).round().astype(np.uint8)
        return clip

    return generate


#: The README's example (`curl ... -F prompt=... -F seed=1`), for its frame strip.
README_PROMPT, README_SEED = "a red circle moving right", 1


def write_readme_sample(folder: str | Path, path: str | Path, *, steps: int = DEFAULT_STEPS,
                        guidance: float = DEFAULT_GUIDANCE) -> ClipRecord:
    """The README's frame strip: its prompt and seed in-process (stock pipeline), each frame
    upscaled, judged as the evaluation judges. Returns the clip's record."""
    clip = pipeline_generator(folder, steps=steps, guidance=guidance)(README_PROMPT, README_SEED)
    record = _record(README_PROMPT, clip)
    _strip(clip, record).save(path)
    return record


def main() -> None:
    parser = eval_parser("Judge a tiny-shapes-video folder in-process.")
    parser.add_argument("--prompts", type=int, default=0, help="0 = every held-out prompt")
    parser.add_argument("--sample", default=None, help="also write the README's strip here")
    args = parser.parse_args()
    start_cli(args)
    generate = pipeline_generator(args.folder, steps=args.steps, guidance=args.guidance)
    metrics = evaluate(generate, args.out_dir, held_out_prompts(args.prompts), seed=args.seed)
    print(json.dumps(metrics["accuracy"]))
    if args.sample:
        logger.info("README strip: %s", write_readme_sample(
            args.folder, args.sample, steps=args.steps, guidance=args.guidance)["verdict"])


if __name__ == "__main__":
    main()
