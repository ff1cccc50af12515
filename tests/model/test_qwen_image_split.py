"""The Qwen-Image folder split over the Tokenizer, DiT and VAE adapters equals the pipeline."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline

from stagemesh.models import qwen_image
from stagemesh.models.families.qwen_image import PromptEmbeddings, latent_factor
from stagemesh.services.dit.qwen_image_adapter import (
    DenoiseAdapter,
    DenoiseInput,
    DenoiseState,
    DitLimits,
)
from stagemesh.services.dit.types import DenoisedLatents
from stagemesh.services.tokenizer.base import PromptInput, TokenizerLimits
from stagemesh.services.tokenizer.qwen_image_adapter import PromptEncoderAdapter
from stagemesh.services.vae.limits import VaeLimits
from stagemesh.services.vae.qwen_image_adapter import (
    DecodedImages,
    LatentDecoderAdapter,
    LatentsInput,
)
from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    StepOutput,
)
from stagemesh.shared.limits import MAX_SEED

PROMPT = "a red circle on the left"
SIZE = 64
STEPS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen_image.build_tiny_qwen_image(tmp_path_factory.mktemp("qwen-image") / "tiny")


@pytest.fixture(scope="module")
def encoder(model_dir: Path) -> PromptEncoderAdapter:
    return PromptEncoderAdapter(model_dir)


@pytest.fixture(scope="module")
def dit(model_dir: Path) -> DenoiseAdapter:
    return DenoiseAdapter(model_dir)


@pytest.fixture(scope="module")
def decoder(model_dir: Path) -> LatentDecoderAdapter:
    return LatentDecoderAdapter(model_dir)


@pytest.fixture(scope="module")
def pipe(model_dir: Path) -> QwenImagePipeline:
    pipe = QwenImagePipeline.from_pretrained(model_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run_single_step(adapter: Any, payload: Any) -> Any:
    """check_inputs -> prepare -> step -> finish -> release, as the engine drives a stage."""
    adapter.check_inputs(payload)
    state = adapter.prepare(EngineRequest(request_id="r", payload=payload))
    (out,) = adapter.step([state])
    assert out == StepOutput(step_index=1, finished=True)
    result = adapter.finish(state)
    adapter.release(state)
    return result


def _denoise_input(embeddings: PromptEmbeddings, seed: int, cfg: float) -> DenoiseInput:
    return DenoiseInput(embeddings, SIZE, SIZE, STEPS, true_cfg_scale=cfg, seed=seed)


def _start(dit: DenoiseAdapter, payload: DenoiseInput) -> DenoiseState:
    dit.check_inputs(payload)
    return dit.prepare(EngineRequest(request_id=str(payload.seed), payload=payload))


def _step(dit: DenoiseAdapter, state: DenoiseState, expected_index: int) -> None:
    (out,) = dit.step([state])
    assert out.step_index == expected_index
    assert out.finished == (expected_index == STEPS)


def _finish(dit: DenoiseAdapter, state: DenoiseState) -> DenoisedLatents:
    result = dit.finish(state)
    dit.release(state)
    return result


def _denoise(dit: DenoiseAdapter, payload: DenoiseInput) -> DenoisedLatents:
    state = _start(dit, payload)
    for i in range(STEPS):
        _step(dit, state, i + 1)
    return _finish(dit, state)


def _mesh(
    encoder: PromptEncoderAdapter,
    dit: DenoiseAdapter,
    decoder: LatentDecoderAdapter,
    negative_prompt: str | None,
    cfg: float,
    seed: int = 0,
) -> DecodedImages:
    embeddings = _run_single_step(encoder, PromptInput(PROMPT, negative_prompt))
    latents = _denoise(dit, _denoise_input(embeddings, seed, cfg))
    return _run_single_step(decoder, LatentsInput(latents.latents, latents.height, latents.width))


@pytest.mark.parametrize(("negative_prompt", "cfg"), [(None, 1.0), ("blurry", 4.0)])
def test_mesh_equals_pipeline(
    encoder: PromptEncoderAdapter,
    dit: DenoiseAdapter,
    decoder: LatentDecoderAdapter,
    pipe: QwenImagePipeline,
    negative_prompt: str | None,
    cfg: float,
) -> None:
    mesh = _mesh(encoder, dit, decoder, negative_prompt, cfg)
    kwargs: dict[str, Any] = {
        "prompt": PROMPT,
        "negative_prompt": negative_prompt,
        "true_cfg_scale": cfg,
        "height": SIZE,
        "width": SIZE,
        "num_inference_steps": STEPS,
    }
    reference = pipe(**kwargs, generator=torch.Generator().manual_seed(0), output_type="np")
    pil = pipe(**kwargs, generator=torch.Generator().manual_seed(0), output_type="pil")
    assert mesh.images.shape == (1, SIZE, SIZE, 3)
    assert np.abs(mesh.images - reference.images).max() <= 1e-5
    assert mesh.pixels.dtype == np.uint8
    np.testing.assert_array_equal(mesh.pixels[0], np.asarray(pil.images[0]))


def test_guidance_changes_the_image(
    encoder: PromptEncoderAdapter, dit: DenoiseAdapter, decoder: LatentDecoderAdapter
) -> None:
    plain = _mesh(encoder, dit, decoder, None, 4.0)  # no negative prompt: guidance stays off
    also_plain = _mesh(encoder, dit, decoder, "blurry", 1.0)  # scale <= 1: guidance stays off
    guided = _mesh(encoder, dit, decoder, "blurry", 4.0)
    np.testing.assert_array_equal(plain.images, also_plain.images)
    assert np.abs(plain.images - guided.images).max() > 1e-3


def test_interleaved_requests_equal_sequential(
    encoder: PromptEncoderAdapter, dit: DenoiseAdapter
) -> None:
    emb_a = _run_single_step(encoder, PromptInput("a blue square", "dark"))
    emb_b = _run_single_step(encoder, PromptInput("a green triangle at the top"))
    payload_a = _denoise_input(emb_a, seed=1, cfg=4.0)
    payload_b = replace(_denoise_input(emb_b, seed=2, cfg=1.0), sigmas=[1.0, 0.7, 0.4, 0.1])
    sequential = [_denoise(dit, payload_a).latents, _denoise(dit, payload_b).latents]

    state_a, state_b = _start(dit, payload_a), _start(dit, payload_b)
    for i in range(STEPS):
        _step(dit, state_a, i + 1)
        _step(dit, state_b, i + 1)
    interleaved = [_finish(dit, state_a).latents, _finish(dit, state_b).latents]

    assert not torch.equal(sequential[0], sequential[1])
    for got, want in zip(interleaved, sequential, strict=True):
        assert torch.equal(got, want)


def test_release_frees_the_state(encoder: PromptEncoderAdapter, dit: DenoiseAdapter) -> None:
    embeddings = _run_single_step(encoder, PromptInput(PROMPT))
    state = _start(dit, _denoise_input(embeddings, seed=0, cfg=1.0))
    dit.release(state)
    assert state.work is None
    with pytest.raises(RuntimeError, match="after release"):
        dit.step([state])


def test_batch_key_is_the_image_size(encoder: PromptEncoderAdapter, dit: DenoiseAdapter) -> None:
    """Guided and unguided requests share a forward; different sizes cannot."""
    embeddings = _run_single_step(encoder, PromptInput(PROMPT, ""))
    guided = _start(dit, _denoise_input(embeddings, seed=0, cfg=4.0))
    plain = _start(dit, _denoise_input(embeddings, seed=0, cfg=1.0))
    wide = _start(dit, replace(_denoise_input(embeddings, seed=0, cfg=4.0), width=2 * SIZE))
    assert dit.batch_key(guided) == (SIZE, SIZE)
    assert dit.batch_key(plain) == (SIZE, SIZE)
    assert dit.batch_key(wide) == (SIZE, 2 * SIZE)
    with pytest.raises(ValueError, match="one image size"):
        dit.step([guided, wide])
    assert (guided.step_index, wide.step_index) == (0, 0)


# -- validation ---------------------------------------------------------------------------------


def _field_of(adapter: Any, payload: Any) -> str:
    with pytest.raises(InvalidInputError) as info:
        adapter.check_inputs(payload)
    return info.value.field_name


def _token_field_of(encoder: PromptEncoderAdapter, payload: PromptInput) -> str:
    """Tokens are counted in prepare (on the engine thread), after check_inputs passed."""
    encoder.check_inputs(payload)
    with pytest.raises(InvalidInputError) as info:
        encoder.prepare(EngineRequest(request_id="r", payload=payload))
    return info.value.field_name


def test_prompt_validation(encoder: PromptEncoderAdapter) -> None:
    assert _field_of(encoder, PromptInput("")) == "prompt"
    assert _field_of(encoder, PromptInput("   ")) == "prompt"
    assert _field_of(encoder, PromptInput(PROMPT, max_sequence_length=0)) == "max_sequence_length"
    assert _field_of(encoder, PromptInput(PROMPT, max_sequence_length=1025)) == (
        "max_sequence_length"
    )
    # the stage's limit (512 unless configured) also bounds what a request may ask for
    assert _field_of(encoder, PromptInput(PROMPT, max_sequence_length=513)) == (
        "max_sequence_length"
    )
    assert _field_of(encoder, PromptInput("x" * 2001)) == "prompt"
    assert _field_of(encoder, PromptInput(PROMPT, "x" * 2001)) == "negative_prompt"
    n_tokens = encoder.prompt_token_count(PROMPT)
    at_limit = PromptInput(PROMPT, max_sequence_length=n_tokens)  # exactly at the limit
    encoder.check_inputs(at_limit)
    encoder.prepare(EngineRequest(request_id="r", payload=at_limit))
    too_long = PromptInput(PROMPT, max_sequence_length=n_tokens - 1)
    assert _token_field_of(encoder, too_long) == "prompt"
    long_negative = PromptInput("a cat", PROMPT * 4, max_sequence_length=n_tokens)
    assert _token_field_of(encoder, long_negative) == "negative_prompt"


def test_denoise_validation(encoder: PromptEncoderAdapter, dit: DenoiseAdapter) -> None:
    embeddings = _run_single_step(encoder, PromptInput(PROMPT))
    good = _denoise_input(embeddings, seed=0, cfg=4.0)
    dit.check_inputs(good)
    factor = dit.latent_factor
    wrong_dim = torch.zeros(1, 3, embeddings.prompt_embeds.shape[-1] + 1)
    cases = {
        "size": [replace(good, height=SIZE + factor // 2), replace(good, width=0)],
        "num_inference_steps": [replace(good, num_inference_steps=0)],
        "sigmas": [replace(good, sigmas=[1.0, 0.5]), replace(good, sigmas=[1.0, 0.5, 0.2, 0.0])],
        "true_cfg_scale": [replace(good, true_cfg_scale=-1.0), replace(good, true_cfg_scale=1e9)],
        "seed": [replace(good, seed=-1), replace(good, seed=MAX_SEED + 1)],
        "embeddings": [
            replace(good, embeddings=PromptEmbeddings(wrong_dim, None)),
            replace(good, embeddings=replace(embeddings, negative_prompt_embeds=wrong_dim)),
        ],
    }
    for field_name, payloads in cases.items():
        for payload in payloads:
            assert _field_of(dit, payload) == field_name


def test_decode_validation(decoder: LatentDecoderAdapter) -> None:
    factor = decoder.latent_factor
    tokens = (SIZE // factor) ** 2
    channels = decoder.vae.config.z_dim * 4
    decoder.check_inputs(LatentsInput(torch.zeros(1, tokens, channels), SIZE, SIZE))
    assert _field_of(decoder, LatentsInput(torch.zeros(1, tokens, channels), SIZE + 1, SIZE)) == (
        "size"
    )
    assert _field_of(decoder, LatentsInput(torch.zeros(1, tokens + 1, channels), SIZE, SIZE)) == (
        "latents"
    )
    nan = torch.full((1, tokens, channels), float("nan"))
    assert _field_of(decoder, LatentsInput(nan, SIZE, SIZE)) == "latents"


# -- the builder --------------------------------------------------------------------------------


def test_builder_is_deterministic_and_loads_offline(
    model_dir: Path, pipe: QwenImagePipeline, tmp_path: Path
) -> None:
    again = qwen_image.build_tiny_qwen_image(tmp_path / "again")
    weights = sorted(p.relative_to(model_dir) for p in model_dir.rglob("*.safetensors"))
    assert len(weights) == 3  # transformer, vae, text_encoder
    for rel in weights:
        assert (model_dir / rel).read_bytes() == (again / rel).read_bytes(), rel
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    assert type(pipe.tokenizer).__name__ == "Qwen2Tokenizer"
    assert len(pipe.tokenizer) == pipe.text_encoder.config.text_config.vocab_size
    # The real Qwen2.5 tokenizer: the template's system prefix is the 34 tokens the pipeline drops.
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx
    assert latent_factor(model_dir) == 16


def test_ensure_model_builds_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    builds: list[Path] = []

    def fake_build(out_dir: Path, *, preset: str, seed: int) -> Path:
        builds.append(out_dir)
        out_dir.mkdir(exist_ok=True)
        (out_dir / "stagemesh_build.json").write_text(json.dumps(qwen_image._stamp(preset, seed)))
        return out_dir

    monkeypatch.setenv("STAGEMESH_CACHE", str(tmp_path))
    monkeypatch.setattr(qwen_image, "build_tiny_qwen_image", fake_build)
    first = qwen_image.ensure_model("tiny")
    assert first == tmp_path / "models" / "qwen-image-tiny"
    assert qwen_image.ensure_model("tiny") == first
    assert len(builds) == 1 and builds[0] != first  # built aside, then renamed into place

    (first / "stagemesh_build.json").write_text("{}")  # a folder from an older builder
    assert qwen_image.ensure_model("tiny") == first
    assert len(builds) == 2
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["qwen-image-tiny"]
    with pytest.raises(ValueError, match="unknown preset"):
        qwen_image.ensure_model("huge")


# -- limits and options -------------------------------------------------------------------------


def test_limits_are_published(
    encoder: PromptEncoderAdapter, dit: DenoiseAdapter, decoder: LatentDecoderAdapter
) -> None:
    assert encoder.limits == TokenizerLimits(max_prompt_chars=2000, max_sequence_length=512)
    assert dit.limits == DitLimits(
        size_multiple=16,
        max_side=2048,
        max_pixels=1024 * 1024,
        max_steps=200,
        max_true_cfg_scale=20.0,
        max_images_per_request=4,
        min_steps=2,  # the tiny model's schedule stretches to a terminal shift
    )
    assert decoder.limits == VaeLimits(size_multiple=16, max_side=2048)


def test_dit_options_are_capped_by_the_model(model_dir: Path) -> None:
    loose = DenoiseAdapter(
        model_dir, max_steps=5000, max_side=4096, max_pixels=10**9, max_true_cfg_scale=100.0
    )
    assert (loose.limits.max_steps, loose.limits.max_side) == (1000, 2048)
    assert loose.limits.max_pixels == 2048 * 2048
    assert loose.limits.max_true_cfg_scale == 30.0
    assert DenoiseAdapter(model_dir, max_side=1000).limits.max_side == 992  # a multiple of 16


def test_dit_refusals_follow_the_options(encoder: PromptEncoderAdapter, model_dir: Path) -> None:
    tight = DenoiseAdapter(
        model_dir, max_steps=3, max_side=48, max_pixels=48 * 32, max_true_cfg_scale=2.0
    )
    embeddings = _run_single_step(encoder, PromptInput(PROMPT))
    good = DenoiseInput(embeddings, 32, 48, 3, true_cfg_scale=2.0, seed=0)
    tight.check_inputs(good)
    cases = {
        "num_inference_steps": replace(good, num_inference_steps=4),
        "size": replace(good, height=48),  # 48x48 is over max_pixels, each side is not
        "true_cfg_scale": replace(good, true_cfg_scale=2.5),
    }
    for field_name, payload in cases.items():
        assert _field_of(tight, payload) == field_name
    assert _field_of(tight, replace(good, width=64)) == "size"  # over max_side


@pytest.mark.parametrize(
    "options",
    [{"max_steps": 0}, {"max_side": 8}, {"max_pixels": -1}, {"max_images_per_request": 0}],
)
def test_bad_dit_options_fail_at_construction(model_dir: Path, options: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        DenoiseAdapter(model_dir, **options)


def test_tokenizer_options(model_dir: Path) -> None:
    loose = PromptEncoderAdapter(model_dir, max_sequence_length=4096)
    assert loose.limits.max_sequence_length == 1024  # the pipeline's tokenizer_max_length
    tight = PromptEncoderAdapter(model_dir, max_prompt_chars=30, max_sequence_length=8)
    assert tight.limits == TokenizerLimits(max_prompt_chars=30, max_sequence_length=8)
    assert _field_of(tight, PromptInput("x" * 31)) == "prompt"
    assert _field_of(tight, PromptInput("a cat", "x" * 31)) == "negative_prompt"
    assert _field_of(tight, PromptInput("a cat", max_sequence_length=9)) == "max_sequence_length"
    assert len(PROMPT) <= 30 and tight.prompt_token_count(PROMPT) > 8
    assert _token_field_of(tight, PromptInput(PROMPT)) == "prompt"  # too many tokens
    tight.check_inputs(PromptInput("a cat"))
    with pytest.raises(ValueError, match="max_prompt_chars"):
        PromptEncoderAdapter(model_dir, max_prompt_chars=0)


def test_no_max_sequence_length_means_the_stage_limit(encoder: PromptEncoderAdapter) -> None:
    state = encoder.prepare(EngineRequest(request_id="r", payload=PromptInput(PROMPT)))
    assert state.max_sequence_length == encoder.limits.max_sequence_length
