"""`stagemesh eval tiny-shapes`: score the shipped model through a running mesh, over REST.

Every prompt goes to `POST /v1/images/generations` of a running gateway (`stagemesh serve`), so
the numbers measure the whole mesh — Tokenizer, DiT and VAE as separate services — not an
in-process pipeline.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import logging

import httpx
import numpy as np
from PIL import Image

from stagemesh.models.tiny_shapes.data import IMAGE_SIZE
from stagemesh.models.tiny_shapes.evaluate import (
    DEFAULT_GUIDANCE,
    DEFAULT_STEPS,
    Generate,
    evaluate,
    subset_prompts,
)

log = logging.getLogger(__name__)


def checked(response: httpx.Response, url: str) -> httpx.Response:
    """`response` if it is a 200, else a RuntimeError with what the gateway at `url` said."""
    if response.status_code != 200:
        raise RuntimeError(f"{url} answered {response.status_code}: {response.text}")
    return response


def answered_png(response: httpx.Response, url: str) -> np.ndarray:
    """The RGB pixels of the first image of an OpenAI images answer (a 200)."""
    png = base64.b64decode(checked(response, url).json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def rest_generator(url: str, *, model: str = "", steps: int = DEFAULT_STEPS,
                   guidance: float = DEFAULT_GUIDANCE, size: int = IMAGE_SIZE,
                   timeout: float = 120.0) -> Generate:
    """A `Generate` that asks a running gateway for each image."""
    client = httpx.Client(base_url=url, timeout=timeout)

    def generate(prompt: str, seed: int) -> np.ndarray:
        return answered_png(client.post("/v1/images/generations", json={
            "model": model, "prompt": prompt, "size": f"{size}x{size}", "seed": seed,
            "num_inference_steps": steps, "true_cfg_scale": guidance, "negative_prompt": ""}),
            url)

    return generate


def main(args: argparse.Namespace) -> None:
    """Run the grammar (or a subset) through the mesh at `args.url`; write JSON + grid."""
    generate = rest_generator(args.url, model=args.model_name, steps=args.steps,
                              guidance=args.guidance)
    prompts = subset_prompts(args.subset) if args.subset else None
    metrics = evaluate(generate, args.out, prompts, seed=args.seed)
    log.info("wrote %s/metrics.json and %s/grid.png", args.out, args.out)
    print(json.dumps({"n": metrics["n"], "accuracy": metrics["accuracy"]}, indent=2))
