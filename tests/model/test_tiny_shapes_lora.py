"""The shipped tiny-shapes LoRA (assets/tiny-shapes-loras/night) on the DiT stage's adapter: the
stage finds it in `lora_dir`, and a request naming it draws its prompt on a black background (the
effect metric of models/tiny_shapes/lora.py) in the right colour and place, where the same request
without it draws the background the prompt names. 32 px, 8 steps, three prompts."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline

from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.models.tiny_shapes import SHIPPED_DIR
from stagemesh.models.tiny_shapes import lora as tiny_lora
from stagemesh.models.tiny_shapes.lora import NAME, SHIPPED_LORA_DIR, shows_style
from stagemesh.models.tiny_shapes.scoring import ATTRIBUTES, score
from stagemesh.services.dit.lora import LoraConfig, LoraUse
from stagemesh.services.dit.qwen_image_adapter import DenoiseAdapter, DenoiseInput
from stagemesh.services.vae.qwen_image_adapter import LatentDecoderAdapter, LatentsInput
from stagemesh.shared.engine import EngineRequest

PROMPTS = ("a red circle", "a blue square on the left on a gray background",
           "a yellow triangle at the bottom on a gray background")
SIZE, STEPS, CFG, SEED = 32, 8, 4.0, 0


def _embeddings(pipe: QwenImagePipeline, prompt: str) -> PromptEmbeddings:
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(prompt, device=torch.device("cpu"))
        negative, negative_mask = pipe.encode_prompt("", device=torch.device("cpu"))
    return PromptEmbeddings(embeds, mask, negative, negative_mask)


def _draw(dit: DenoiseAdapter, vae: LatentDecoderAdapter, embeddings: PromptEmbeddings,
          lora: tuple[LoraUse, ...]) -> np.ndarray:
    payload = DenoiseInput(embeddings, SIZE, SIZE, STEPS, CFG, SEED, lora=lora)
    dit.check_inputs(payload)
    state = dit.prepare(EngineRequest(request_id="r", payload=payload))
    while not dit.step([state])[0].finished:
        pass
    latents = dit.finish(state).latents
    dit.release(state)
    pixels: np.ndarray = vae.decode(LatentsInput(latents, SIZE, SIZE)).pixels[0]
    return pixels


@pytest.mark.timeout(300)
def test_shipped_adapter_draws_on_black_on_the_dit_stage() -> None:
    pipe = QwenImagePipeline.from_pretrained(SHIPPED_DIR, local_files_only=True)
    dit = DenoiseAdapter(SHIPPED_DIR, lora=LoraConfig.from_options(
        {"lora_dir": str(SHIPPED_LORA_DIR), "max_lora_rank": 8}))
    vae = LatentDecoderAdapter(SHIPPED_DIR)
    assert NAME in dit.loras.names
    for prompt in PROMPTS:
        embeddings = _embeddings(pipe, prompt)
        base = _draw(dit, vae, embeddings, ())
        styled = _draw(dit, vae, embeddings, (LoraUse(NAME, 1.0),))
        assert score(base, prompt)["background"] and not shows_style(base), prompt
        assert shows_style(styled), prompt
        assert score(styled, prompt)["colour"] and score(styled, prompt)["position"], prompt


@pytest.mark.timeout(300)
def test_training_writes_an_adapter_that_the_evaluation_loads(tmp_path: Path) -> None:
    adapter, out = tmp_path / "adapter", tmp_path / "eval"
    report = tiny_lora.train_lora(SHIPPED_DIR, adapter, config=tiny_lora.LoraConfig.smoke())
    assert report["style_background"] == tiny_lora.STYLE_BACKGROUND
    assert (adapter / "pytorch_lora_weights.safetensors").is_file()
    metrics = tiny_lora.evaluate_lora(SHIPPED_DIR, adapter, out, n=3, steps=2)
    assert metrics["n"] == 3 and set(metrics["adapter_scores"]) == {"effect", *ATTRIBUTES}
    assert (out / "lora-metrics.json").is_file() and (out / "lora-grid.png").is_file()
