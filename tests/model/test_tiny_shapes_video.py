"""tiny-shapes-video with a model: the training path end to end at smoke size (clips, split and
judge: tests/unit/test_tiny_shapes_video_data.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel
from safetensors import safe_open

from stagemesh.models.families.wan import WanGeometry
from stagemesh.models.tiny_shapes_video.data import NUM_FRAMES, PROMPT_TOKENS
from stagemesh.models.tiny_shapes_video.evaluate import (
    evaluate,
    held_out_prompts,
    pipeline_generator,
)
from stagemesh.models.tiny_shapes_video.probe import ATTRIBUTES, SIGMAS, attribute_sensitivity
from stagemesh.models.tiny_shapes_video.train import (
    VideoTrainConfig,
    build_pipeline,
    prompt_embeds,
    train,
)


def test_smoke_training_writes_a_wan_folder_the_stock_pipeline_runs(tmp_path: Path) -> None:
    out = train(tmp_path / "video", config=VideoTrainConfig.smoke())
    report = json.loads((out / "training.json").read_text())
    assert report["seed"] == 0 and report["config"] == json.loads(
        json.dumps(VideoTrainConfig.smoke().__dict__))
    assert report["load_average_1min"]["samples"] >= 1
    assert set(report["seconds"]) == {"render", "vae", "encode", "dit"}
    # The last write is the finished run (a checkpoint every step here was replaced whole).
    assert report["dit_steps_done"] == VideoTrainConfig.smoke().dit_steps
    assert report["prompt_tokens"] == PROMPT_TOKENS
    assert not out.with_name(out.name + ".writing").exists()
    assert {"psnr_db", "recon_correct"} <= set(report["vae"])
    assert report["vae_curve"]["2"] == report["vae"]  # judged after the last step, the same
    # Started from tiny-shapes' image VAE, two steps on single frames keep it judging right.
    assert report["vae"]["recon_correct"] == 1.0, report["vae"]
    # The VAE is 4x in space and time, as the mesh's Wan stages read it off the folder.
    facts = WanGeometry.from_folder(out)
    assert (facts.spatial_factor, facts.temporal_factor) == (4, 4)
    assert facts.latent_frames(NUM_FRAMES) == 3
    # The transformer is stored in float16 (the 15 MB budget) and loads back as float32.
    with safe_open(str(out / "transformer" / "diffusion_pytorch_model.safetensors"), "pt") as f:
        names = f.keys()  # (a safe_open handle is not iterable)
        assert {f.get_slice(name).get_dtype() for name in names} == {"F16"}
    loaded = WanTransformer3DModel.from_pretrained(out, subfolder="transformer")
    assert loaded.dtype == torch.float32
    # The stock WanPipeline loads it and makes 9 frames of 32x32 that the judge can read.
    generate = pipeline_generator(out, steps=1)
    metrics = evaluate(generate, tmp_path / "eval", held_out_prompts(1))
    assert metrics["n"] == 1 and set(metrics["accuracy"]) == {
        "shape_colour", "motion", "background", "correct"}
    assert (tmp_path / "eval" / "strips.png").exists()
    clip = generate("a red circle moving right", 0)
    assert clip.shape == (NUM_FRAMES, 32, 32, 3) and clip.dtype == np.uint8
    assert np.array_equal(clip, generate("a red circle moving right", 0))  # seeded
    # The word probe reads the folder: a loss ratio per swapped attribute at each sigma.
    table = attribute_sensitivity(out, n=4)
    assert list(table) == [f"sigma {s}" for s in SIGMAS]
    assert all(set(row) == {"loss", *ATTRIBUTES} and min(row.values()) > 0.0
               for row in table.values())


def test_a_transformer_token_can_hold_every_latent_frame_of_one_latent_pixel() -> None:
    cfg = replace(VideoTrainConfig.smoke(), dit_patch_frames=3, dit_patch_side=1)
    pipe = build_pipeline(cfg, seed=0)
    assert list(pipe.transformer.config.patch_size) == [3, 1, 1]
    latents = torch.randn(1, 16, 3, 8, 8)  # 9 frames of 32x32: 64 tokens (Wan's layout: 48)
    with torch.no_grad():  # the stock WanPipeline runs such a folder (the smoke test's path)
        out = pipe.transformer(hidden_states=latents, timestep=torch.tensor([500.0]),
                               encoder_hidden_states=prompt_embeds(pipe, ["a red circle"]),
                               return_dict=False)[0]
    assert out.shape == latents.shape
