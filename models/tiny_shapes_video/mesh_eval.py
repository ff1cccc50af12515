"""`stagemesh eval tiny-shapes-video`: judge the video model through a running mesh.

Every held-out prompt goes to `POST /v1/videos/sync` of a running gateway (`stagemesh serve`)
and comes back as an MP4, so the numbers measure the whole mesh (tokenizer, DiT and VAE as
separate services, and the H.264 encoding a client sees), not an in-process pipeline.
"""

from __future__ import annotations

import argparse
import io
import json
import logging

import httpx
import numpy as np

from stagemesh.models.tiny_shapes.data import IMAGE_SIZE
from stagemesh.models.tiny_shapes.evaluate import DEFAULT_GUIDANCE, DEFAULT_STEPS
from stagemesh.models.tiny_shapes.mesh_eval import checked
from stagemesh.models.tiny_shapes_video.data import NUM_FRAMES
from stagemesh.models.tiny_shapes_video.evaluate import (
    VideoGenerate,
    evaluate,
    held_out_prompts,
)

log = logging.getLogger(__name__)

#: Frames per second asked for; it only sets the MP4's timing, not what is drawn.
FPS = 8


def mp4_clip(data: bytes) -> np.ndarray:
    """The frames of an MP4 as a uint8 (frames, H, W, 3) array."""
    import av  # PyAV is the GPL [video-gpl] extra: imported only when a clip is read

    with av.open(io.BytesIO(data), "r") as container:
        return np.stack([frame.to_ndarray(format="rgb24")
                         for frame in container.decode(video=0)])


def rest_video_generator(url: str, *, model: str = "tiny-shapes-video",
                         steps: int = DEFAULT_STEPS, guidance: float = DEFAULT_GUIDANCE,
                         size: int = IMAGE_SIZE, frames: int = NUM_FRAMES,
                         timeout: float = 300.0) -> VideoGenerate:
    """A `VideoGenerate` that asks a running gateway for each clip."""
    client = httpx.Client(base_url=url, timeout=timeout)

    def generate(prompt: str, seed: int) -> np.ndarray:
        return mp4_clip(checked(client.post("/v1/videos/sync", data={
            "model": model, "prompt": prompt, "negative_prompt": "", "size": f"{size}x{size}",
            "num_frames": str(frames), "fps": str(FPS), "num_inference_steps": str(steps),
            "guidance_scale": str(guidance), "seed": str(seed)}), url).content)

    return generate


def main(args: argparse.Namespace) -> None:
    """Run the held-out prompts (`args.prompts`, 0 = all) through the mesh at `args.url`."""
    generate = rest_video_generator(args.url, model=args.model_name, steps=args.steps,
                                    guidance=args.guidance)
    metrics = evaluate(generate, args.out, held_out_prompts(args.prompts), seed=args.seed)
    log.info("wrote %s/metrics.json and %s/strips.png", args.out, args.out)
    print(json.dumps({"n": metrics["n"], "accuracy": metrics["accuracy"]}, indent=2))
