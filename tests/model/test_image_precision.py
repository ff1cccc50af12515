"""The image stages (Tokenizer, DiT, VAE) in reduced precision on the CPU, against the stock
`QwenImagePipeline` loaded in the same dtype, on the shipped trained model (tiny-shapes).

Tolerances, in units of the dtype's unit roundoff u = finfo(dtype).eps / 2 (2^-8 for bfloat16,
2^-11 for float16), for 16 denoise steps at 32x32:

- Without guidance the mesh runs exactly the pipeline's arithmetic (one row per forward, the
  same kernels), so the images are equal, bit for bit: this is also what shows the stages
  really compute in the dtype (float32 and bfloat16 pipelines differ by 1e-3 on average).
- With true CFG the DiT puts the conditional and the unconditional row into one forward where
  the pipeline runs two; a batched matrix product may round an element differently in its last
  place, and 16 Euler steps carry that forward. Images in [0, 1]: at most 16u at any element,
  u/2 on average (measured: bfloat16 5u and 0.17u; float16 6u and 0.23u).
- A request batched with another (different prompt, seed and step) against the same request
  alone: latents within 16u of their largest magnitude (measured: bfloat16 4.8u, float16 3.1u).
- The VAE stage computes its causal 3-D convolutions on one frame as the 2-D convolutions they
  equal (`services/vae/single_frame.py`, a third of the cost): the pipeline's VAE here takes the
  same path, so "exactly" means the same kernels; against the stock 3-D path the images differ
  in the last place only (the float32 parity tests bound it).
- Step mode (one engine step per tick) and request mode (the whole loop in one tick) run the
  same arithmetic: equal in every dtype, bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from prometheus_client import CollectorRegistry

from stagemesh.bench.dtypes import run_request as run
from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.models.registry import SHIPPED_TINY_SHAPES
from stagemesh.services.dit.qwen_image_adapter import DenoiseAdapter, DenoiseInput
from stagemesh.services.dit.types import DenoisedLatents
from stagemesh.services.tokenizer.base import PromptInput
from stagemesh.services.tokenizer.qwen_image_adapter import PromptEncoderAdapter
from stagemesh.services.vae.qwen_image_adapter import (
    DecodedImages,
    LatentDecoderAdapter,
    LatentsInput,
)
from stagemesh.services.vae.single_frame import use_single_frame_convs
from stagemesh.shared.devices import Placement
from stagemesh.shared.engine.adapter import EngineRequest, ExecutionMode, StepBudget
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.engine.events import Completed
from stagemesh.shared.engine.metrics import EngineMetrics

SIZE, STEPS = 32, 16
UNGUIDED = ("a red circle on the left", None, 1.0, 3)
GUIDED = ("a blue square at the top", "", 4.0, 5)
REDUCED = [torch.bfloat16, torch.float16]
ALL_DTYPES = [torch.float32, *REDUCED]


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


class Stages:
    """The three image adapters in one placement."""

    def __init__(self, dtype: torch.dtype) -> None:
        placement = Placement(torch.device("cpu"), dtype)
        self.dtype = dtype
        self.encoder = PromptEncoderAdapter(SHIPPED_TINY_SHAPES, placement=placement)
        self.dit = DenoiseAdapter(SHIPPED_TINY_SHAPES, placement=placement)
        self.vae = LatentDecoderAdapter(SHIPPED_TINY_SHAPES, placement=placement)

    def embeddings(self, prompt: str, negative: str | None) -> PromptEmbeddings:
        return run(self.encoder, PromptInput(prompt, negative))

    def denoise(self, payload: DenoiseInput) -> DenoisedLatents:
        return run(self.dit, payload)

    def image(self, prompt: str, negative: str | None, scale: float, seed: int) -> DecodedImages:
        embeddings = self.embeddings(prompt, negative)
        latents = self.denoise(DenoiseInput(embeddings, SIZE, SIZE, STEPS,
                                            true_cfg_scale=scale, seed=seed))
        return run(self.vae, LatentsInput(latents.latents, latents.height, latents.width))


@pytest.fixture(scope="module", params=REDUCED, ids=str)
def stages(request: pytest.FixtureRequest) -> Stages:
    return Stages(request.param)


@pytest.fixture(scope="module")
def pipe(stages: Stages) -> Iterator[QwenImagePipeline]:
    pipe = QwenImagePipeline.from_pretrained(SHIPPED_TINY_SHAPES, dtype=stages.dtype,
                                             local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    use_single_frame_convs(pipe.vae)  # the VAE stage's one-frame convolutions, same kernels
    yield pipe


def stock(pipe: QwenImagePipeline, prompt: str, negative: str | None, scale: float, seed: int,
          output_type: str) -> Any:
    return pipe(prompt, negative_prompt=negative, true_cfg_scale=scale, height=SIZE, width=SIZE,
                num_inference_steps=STEPS, generator=torch.Generator().manual_seed(seed),
                output_type=output_type).images


def test_every_stage_computes_in_its_dtype(stages: Stages) -> None:
    dtype = stages.dtype
    assert {p.dtype for p in stages.encoder._pipeline.text_encoder.parameters()} == {dtype}
    assert {p.dtype for p in stages.dit.transformer.parameters()} == {dtype}
    assert {p.dtype for p in stages.vae.vae.parameters()} == {dtype}
    embeddings = stages.embeddings(*UNGUIDED[:2])
    assert embeddings.prompt_embeds.dtype == dtype  # what the wire carries to the DiT
    latents = stages.denoise(DenoiseInput(embeddings, SIZE, SIZE, 2, true_cfg_scale=1.0, seed=0))
    assert latents.latents.dtype == dtype  # and to the VAE
    decoded = run(stages.vae, LatentsInput(latents.latents, SIZE, SIZE))
    assert decoded.pixels.dtype == np.uint8 and decoded.images.dtype == np.float32


def test_unguided_images_equal_the_pipelines_exactly(stages: Stages,
                                                     pipe: QwenImagePipeline) -> None:
    mesh = stages.image(*UNGUIDED)
    np.testing.assert_array_equal(mesh.images, stock(pipe, *UNGUIDED, "np"))
    np.testing.assert_array_equal(mesh.pixels[0], np.asarray(stock(pipe, *UNGUIDED, "pil")[0]))


def test_guided_images_are_within_the_stated_tolerance(stages: Stages,
                                                       pipe: QwenImagePipeline) -> None:
    u = unit_roundoff(stages.dtype)
    difference = np.abs(stages.image(*GUIDED).images - stock(pipe, *GUIDED, "np"))
    assert difference.max() <= 16 * u
    assert difference.mean() <= u / 2


def test_a_batched_request_is_within_the_stated_tolerance_of_itself_alone(
    stages: Stages,
) -> None:
    dit = stages.dit
    first = DenoiseInput(stages.embeddings("a blue square", "dark"), SIZE, SIZE, STEPS,
                         true_cfg_scale=4.0, seed=1)
    second = DenoiseInput(stages.embeddings("a green triangle at the top", ""), SIZE, SIZE,
                          STEPS + 2, true_cfg_scale=4.0, seed=2)
    alone = stages.denoise(first).latents
    a = dit.prepare(EngineRequest(request_id="a", payload=first))
    b = dit.prepare(EngineRequest(request_id="b", payload=second))
    dit.step([b])  # b is one step ahead: rows at different timesteps share each forward
    while not dit.step([a, b])[0].finished:
        pass
    batched = dit.finish(a).latents
    scale = float(alone.float().abs().max())
    assert float((batched.float() - alone.float()).abs().max()) <= 16 * unit_roundoff(
        stages.dtype) * scale
    for state in (a, b):
        dit.release(state)


async def _engine_latents(dit: DenoiseAdapter, payload: DenoiseInput,
                          mode: ExecutionMode) -> torch.Tensor:
    engine = StepEngine(dit, mode=mode, metrics=EngineMetrics("dit", registry=CollectorRegistry()))
    engine.start()
    try:
        stream = engine.submit(EngineRequest(request_id=mode.value, payload=payload,
                                             budget=StepBudget(total_steps=STEPS)))
        events = [event async for event in stream]
    finally:
        engine.shutdown()
    final = events[-1]
    assert isinstance(final, Completed), final
    latents: torch.Tensor = final.result.latents
    return latents


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
async def test_step_mode_equals_request_mode_in_every_dtype(dtype: torch.dtype) -> None:
    stages = Stages(dtype)
    payload = DenoiseInput(stages.embeddings(*GUIDED[:2]), SIZE, SIZE, STEPS,
                           true_cfg_scale=4.0, seed=7)
    by_step = await _engine_latents(stages.dit, payload, ExecutionMode.STEP)
    by_request = await _engine_latents(stages.dit, payload, ExecutionMode.REQUEST)
    assert by_step.dtype == dtype
    assert torch.equal(by_step, by_request)


def test_the_dit_takes_embeddings_of_another_dtype_in_its_own() -> None:
    """A float32 tokenizer in front of a bfloat16 DiT: the DiT computes in bfloat16 on
    embeddings rounded to it, exactly as if the tokenizer had sent bfloat16."""
    float32, bfloat16 = Stages(torch.float32), Stages(torch.bfloat16)
    embeddings = float32.embeddings(*GUIDED[:2])
    negative = embeddings.negative_prompt_embeds
    assert negative is not None
    rounded = dataclasses.replace(embeddings,
                                  prompt_embeds=embeddings.prompt_embeds.to(torch.bfloat16),
                                  negative_prompt_embeds=negative.to(torch.bfloat16))
    payload = DenoiseInput(embeddings, SIZE, SIZE, 2, true_cfg_scale=4.0, seed=0)
    mixed = bfloat16.denoise(payload).latents
    assert mixed.dtype == torch.bfloat16
    assert torch.equal(mixed, bfloat16.denoise(DenoiseInput(rounded, SIZE, SIZE, 2,
                                                            true_cfg_scale=4.0, seed=0)).latents)
