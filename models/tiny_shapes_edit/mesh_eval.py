"""`stagemesh eval tiny-shapes-edit`: judge the shipped edit model through a running mesh.

Every held-out edit goes to `POST /v1/images/edits` of a running gateway (`stagemesh serve`) as
a PNG, so the numbers measure the whole mesh (Tokenizer with the input image, VAE EncodeImage,
DiT, VAE decode as separate services), not an in-process pipeline.
"""

from __future__ import annotations

import argparse
import io
import json
import logging

import httpx
import numpy as np
from PIL import Image

from stagemesh.models.tiny_shapes.evaluate import DEFAULT_STEPS
from stagemesh.models.tiny_shapes.mesh_eval import answered_png
from stagemesh.models.tiny_shapes_edit.evaluate import (
    EDIT_GUIDANCE,
    EditGenerate,
    evaluate,
    held_out_sample,
)

log = logging.getLogger(__name__)


def png_bytes(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


def rest_edit_generator(url: str, *, model: str = "tiny-shapes-edit",
                        steps: int = DEFAULT_STEPS, guidance: float = EDIT_GUIDANCE,
                        timeout: float = 120.0) -> EditGenerate:
    """An `EditGenerate` that asks a running gateway for each edit, at the input's size."""
    client = httpx.Client(base_url=url, timeout=timeout)

    def generate(image: np.ndarray, instruction: str, seed: int) -> np.ndarray:
        height, width = image.shape[:2]
        return answered_png(client.post("/v1/images/edits", files={
            "image": ("source.png", png_bytes(image), "image/png")}, data={
            "model": model, "prompt": instruction, "size": f"{width}x{height}",
            "seed": str(seed), "num_inference_steps": str(steps),
            "true_cfg_scale": str(guidance), "negative_prompt": ""}), url)

    return generate


def main(args: argparse.Namespace) -> None:
    """Run the held-out edits (`per_kind` of each kind) through the mesh at `args.url`."""
    generate = rest_edit_generator(args.url, model=args.model_name, steps=args.steps,
                                   guidance=args.guidance)
    metrics = evaluate(generate, args.out, held_out_sample(args.per_kind, args.seed),
                       seed=args.seed)
    log.info("wrote %s/metrics.json and %s/grid.png", args.out, args.out)
    print(json.dumps({"n": metrics["n"], "accuracy": metrics["accuracy"]}, indent=2))
