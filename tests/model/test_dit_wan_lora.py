"""LoRA per row on Wan (services/dit/lora_slots.py over wan_forward): a seeded adapter, and
two at two scales, give WanPipeline's latents after `load_lora_weights` + `set_adapters`
within 1e-5 in fp32 (tiny t2v); rows with different adapters share a forward."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest
import torch
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from safetensors.torch import save_file

from stagemesh.models import wan
from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.services.dit.lora import LoraConfig, LoraUse
from stagemesh.services.dit.wan_adapter import VideoDenoiseInput, WanDenoiseAdapter
from stagemesh.shared.engine import EngineRequest
from tests.lora_files import WAN_TARGETS, lora_layers

TOLERANCE = 1e-5
HEIGHT, WIDTH, FRAMES, STEPS = 32, 48, 9, 4


@pytest.fixture(scope="module")
def t2v_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wan.build_tiny_wan(tmp_path_factory.mktemp("wan") / "t2v", variant="t2v")


@pytest.fixture(scope="module")
def lora_dir(t2v_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wan-loras")
    pipe = WanPipeline.from_pretrained(t2v_dir)
    for name, rank, seed in (("ink", 4, 1), ("wax", 2, 2)):
        layers = lora_layers(pipe.transformer, rank, seed, WAN_TARGETS)
        save_file({f"transformer.{k}": v for k, v in layers.items()}, root / f"{name}.safetensors")
    return root


def _payload(seed: int, lora: tuple[LoraUse, ...]) -> VideoDenoiseInput:
    generator = torch.Generator().manual_seed(seed)
    prompt, negative = torch.zeros(2, 1, 512, 32)
    prompt[:, :7] = torch.randn(1, 7, 32, generator=generator)
    negative[:, :3] = torch.randn(1, 3, 32, generator=generator)
    emb = PromptEmbeddings(prompt, None, negative, None)
    return VideoDenoiseInput(emb, HEIGHT, WIDTH, FRAMES, STEPS, 5.0, seed, lora=lora)


def _run(dit: WanDenoiseAdapter, payloads: dict[str, VideoDenoiseInput]) -> dict[str, torch.Tensor]:
    """The payloads stepped together (one batch per step) until each finishes."""
    live = {}
    for name, payload in payloads.items():
        dit.check_inputs(payload)
        live[name] = dit.prepare(EngineRequest(name, payload))
    got = {}
    while live:
        names = list(live)
        for name, out in zip(names, dit.step([live[n] for n in names]), strict=True):
            assert out.error is None
            if out.finished:
                got[name] = dit.finish(live[name]).latents
                dit.release(live.pop(name))
    return got


@pytest.mark.parametrize(
    "uses", [(LoraUse("ink", 0.8),), (LoraUse("ink", 1.2), LoraUse("wax", -0.7))],
    ids=["one", "two"],
)  # fmt: skip
def test_wan_latents_equal_diffusers_set_adapters(
    t2v_dir: Path, lora_dir: Path, uses: tuple[LoraUse, ...]
) -> None:
    pipe = WanPipeline.from_pretrained(t2v_dir)
    for use in uses:
        pipe.load_lora_weights(lora_dir, weight_name=f"{use.name}.safetensors",
                               adapter_name=use.name)  # fmt: skip
    pipe.set_adapters([u.name for u in uses], [u.scale for u in uses])
    payload = _payload(7, uses)
    emb = payload.embeddings
    want = pipe(
        prompt_embeds=emb.prompt_embeds, negative_prompt_embeds=emb.negative_prompt_embeds,
        height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=STEPS,
        guidance_scale=5.0, generator=torch.Generator("cpu").manual_seed(7),
        output_type="latent",
    ).frames  # fmt: skip
    dit = WanDenoiseAdapter(t2v_dir, lora=LoraConfig(directory=lora_dir.resolve(), max_lora_rank=4))
    got = _run(dit, {"r": payload, "plain": _payload(7, ())})
    assert (got["r"] - got["plain"]).abs().max().item() > 100 * TOLERANCE, "no effect"
    assert (got["r"] - want).abs().max().item() <= TOLERANCE
