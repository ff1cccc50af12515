"""The DiT's per-row step cache (services/dit/step_cache.py) on our block loop (forward.py).

first_block with warm-up, final steps and max skips at 0 must reuse exactly the (step, branch)
pairs that diffusers' FirstBlockCacheConfig reuses at the same threshold for a lone request,
with the same latents (fp32, 1e-5), on qwen-image-bench, the edit model and wan-t2v. The
thresholds are chosen so that no decision lies within 1% of them (the test checks it): batch
composition changes rounding, and a decision that close could flip. With the cache on, rows
stay rows: a cancelled batch mate, a preemption or an interrupted forward changes nobody's
result, and a released row gives its cache back.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import FirstBlockCacheConfig, QwenImagePipeline
from diffusers.hooks import first_block_cache
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from PIL import Image

from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.models.registry import resolve_model
from stagemesh.services.dit.adapter import DenoiseAdapter, DenoiseInput, DenoiseState
from stagemesh.services.dit.step_cache import (
    Slot,
    StepCache,
    StepCacheConfig,
    StepCacheMethod,
)
from stagemesh.services.dit.wan_adapter import VideoDenoiseInput, WanDenoiseAdapter
from stagemesh.shared.engine import (
    EngineRequest,
    InvalidInputError,
    StepInterrupt,
    StepInterrupted,
)

TOLERANCE = 1e-5
#: No decision may lie this close (relative) to the threshold.
MARGIN = 0.01

Triple = tuple[int, str, bool]  # (step, branch, reused)


def _fbc(threshold: float) -> StepCacheConfig:
    """first_block exactly as diffusers runs it: no warm-up, no final steps, no skip limit."""
    return StepCacheConfig(
        method=StepCacheMethod.FIRST_BLOCK, threshold=threshold, warmup_steps=0,
        final_steps=0, max_skips=0, max_threshold=1.0,
    )  # fmt: skip


@dataclass
class Spy:
    """What diffusers' FirstBlockCache decided, call by call: (context, change, compute)."""

    calls: list[tuple[str, float | None, bool]]

    def triples(self) -> list[Triple]:
        seen: dict[str, int] = {}
        out = []
        for context, _, compute in self.calls:
            step = seen.get(context, 0)
            seen[context] = step + 1
            out.append((step, context, not compute))
        return sorted(out)

    def assert_clear_of(self, threshold: float) -> None:
        changes = [change for _, change, _ in self.calls if change is not None]
        close = [c for c in changes if abs(c - threshold) <= MARGIN * threshold]
        assert not close, f"decisions within 1% of {threshold}: {close} (pick another threshold)"


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    record = Spy([])
    decide = first_block_cache.FBCHeadBlockHook._should_compute_remaining_blocks

    def spied(hook: Any, residual: torch.Tensor) -> bool:
        state = hook.state_manager.get_state()
        prev = state.head_block_residual
        change = None
        if prev is not None:
            change = ((residual - prev).abs().mean() / prev.abs().mean()).item()
        compute: bool = decide(hook, residual)
        record.calls.append((hook.state_manager.context.name, change, compute))
        return compute

    monkeypatch.setattr(first_block_cache.FBCHeadBlockHook, "_should_compute_remaining_blocks",
                        spied)
    return record


@pytest.fixture
def mesh_decisions(monkeypatch: pytest.MonkeyPatch) -> list[Triple]:
    """Every committed (step, branch, reused) of the stage's step caches."""
    record: list[Triple] = []
    commit = StepCache._commit

    def spied(self: StepCache, slots: Sequence[Slot]) -> None:
        record.extend((s.step, s.branch.value, s.reused) for s in slots)
        commit(self, slots)

    monkeypatch.setattr(StepCache, "_commit", spied)
    return record


def _embeddings(dim: int, seed: int, tokens: int = 9, negative: int = 5) -> PromptEmbeddings:
    generator = torch.Generator().manual_seed(seed)
    return PromptEmbeddings(
        torch.randn(1, tokens, dim, generator=generator), None,
        torch.randn(1, negative, dim, generator=generator), None,
    )  # fmt: skip


def _solo(adapter: DenoiseAdapter | WanDenoiseAdapter, payload: Any, rid: str = "r") -> Any:
    adapter.check_inputs(payload)
    state = adapter.prepare(EngineRequest(request_id=rid, payload=payload))
    while not adapter.step([state])[0].finished:
        pass
    latents = adapter.finish(state).latents
    adapter.release(state)
    return latents


def _check_against_diffusers(
    spy: Spy, mesh: list[Triple], threshold: float, got: torch.Tensor, want: torch.Tensor
) -> None:
    spy.assert_clear_of(threshold)
    assert any(reused for *_, reused in spy.triples()), "the threshold reuses nothing"
    assert sorted(mesh) == spy.triples()
    assert (got - want).abs().max().item() <= TOLERANCE


# -- the same decisions as diffusers' FirstBlockCache -------------------------------------------

BENCH_THRESHOLD, BENCH_STEPS, BENCH_SIZE = 0.79, 8, 64


@pytest.fixture(scope="module")
def bench_dir() -> Path:
    return resolve_model("builtin:qwen-image-bench")


def test_qwen_image_reuses_what_diffusers_reuses(
    bench_dir: Path, spy: Spy, mesh_decisions: list[Triple]
) -> None:
    pipe = QwenImagePipeline.from_pretrained(bench_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=BENCH_THRESHOLD))
    emb = _embeddings(pipe.transformer.config["joint_attention_dim"], 1)
    want = pipe(
        prompt_embeds=emb.prompt_embeds, negative_prompt_embeds=emb.negative_prompt_embeds,
        true_cfg_scale=4.0, height=BENCH_SIZE, width=BENCH_SIZE,
        num_inference_steps=BENCH_STEPS, generator=torch.Generator().manual_seed(3),
        output_type="latent",
    ).images  # fmt: skip
    dit = DenoiseAdapter(bench_dir, step_cache=_fbc(BENCH_THRESHOLD))
    got = _solo(dit, DenoiseInput(emb, BENCH_SIZE, BENCH_SIZE, BENCH_STEPS, 4.0, 3))
    _check_against_diffusers(spy, mesh_decisions, BENCH_THRESHOLD, got, want)
    assert dit.step_cache.held_bytes == 0


EDIT_THRESHOLD, EDIT_STEPS, EDIT_HEIGHT, EDIT_WIDTH = 0.79, 8, 64, 96


def test_qwen_image_edit_reuses_what_diffusers_reuses(
    spy: Spy, mesh_decisions: list[Triple]
) -> None:
    edit_dir = resolve_model("builtin:qwen-image-edit-tiny")
    pipe = QwenImageEditPipeline.from_pretrained(
        edit_dir, local_files_only=True, text_encoder=None, tokenizer=None, processor=None
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=EDIT_THRESHOLD))
    encoded: list[torch.Tensor] = []
    encode = pipe._encode_vae_image

    def hooked(image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        encoded.append(encode(image, generator))
        return encoded[-1]

    pipe._encode_vae_image = hooked  # type: ignore[method-assign]
    emb = _embeddings(pipe.transformer.config["joint_attention_dim"], 2)
    pixels = torch.Generator().manual_seed(0)
    image = Image.fromarray(
        (torch.rand(24, 40, 3, generator=pixels) * 255).to(torch.uint8).numpy()
    )
    want = pipe(
        image=image, prompt_embeds=emb.prompt_embeds,
        negative_prompt_embeds=emb.negative_prompt_embeds, true_cfg_scale=4.0,
        height=EDIT_HEIGHT, width=EDIT_WIDTH, num_inference_steps=EDIT_STEPS,
        generator=torch.Generator().manual_seed(7), output_type="latent",
    ).images  # fmt: skip
    dit = DenoiseAdapter(edit_dir, step_cache=_fbc(EDIT_THRESHOLD))
    payload = DenoiseInput(emb, EDIT_HEIGHT, EDIT_WIDTH, EDIT_STEPS, 4.0, 7,
                           condition_latents=(encoded[0],))
    got = _solo(dit, payload)
    _check_against_diffusers(spy, mesh_decisions, EDIT_THRESHOLD, got, want)


WAN_THRESHOLD, WAN_STEPS = 0.79, 8
WAN_HEIGHT, WAN_WIDTH, WAN_FRAMES = 32, 48, 9


@pytest.fixture(scope="module")
def t2v_dir() -> Path:
    return resolve_model("builtin:wan-t2v-tiny")


def _wan_embeddings(seed: int) -> PromptEmbeddings:
    """Zero-padded to the pipeline's 512 tokens, as the Wan pipelines make them."""
    generator = torch.Generator().manual_seed(seed)
    prompt, negative = torch.zeros(2, 1, 512, 32)
    prompt[:, :7] = torch.randn(1, 7, 32, generator=generator)
    negative[:, :3] = torch.randn(1, 3, 32, generator=generator)
    return PromptEmbeddings(prompt, None, negative, None)


def test_wan_reuses_what_diffusers_reuses(
    t2v_dir: Path, spy: Spy, mesh_decisions: list[Triple]
) -> None:
    pipe = WanPipeline.from_pretrained(t2v_dir, local_files_only=True, text_encoder=None,
                                       tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=WAN_THRESHOLD))
    emb = _wan_embeddings(3)
    want = pipe(
        prompt_embeds=emb.prompt_embeds, negative_prompt_embeds=emb.negative_prompt_embeds,
        guidance_scale=5.0, height=WAN_HEIGHT, width=WAN_WIDTH, num_frames=WAN_FRAMES,
        num_inference_steps=WAN_STEPS, generator=torch.Generator().manual_seed(7),
        output_type="latent",
    ).frames  # fmt: skip
    dit = WanDenoiseAdapter(t2v_dir, step_cache=_fbc(WAN_THRESHOLD))
    payload = VideoDenoiseInput(emb, WAN_HEIGHT, WAN_WIDTH, WAN_FRAMES, WAN_STEPS, 5.0, 7)
    got = _solo(dit, payload)
    _check_against_diffusers(spy, mesh_decisions, WAN_THRESHOLD, got, want)
