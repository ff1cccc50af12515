"""compile=blocks (issue 23): compiled blocks give eager's latents within fp32 roundoff on a
mixed batch, and after the stage's warm-up no size (64/128/256 px) or batch (1..8 rows) compiles
again (`stagemesh_dit_recompiles_total`, read here); likewise for the edit model (a condition
image per request) and Wan (videos)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY

from stagemesh.models.qwen_image import ensure_model
from stagemesh.models.qwen_image_edit import ensure_edit_model
from stagemesh.models.wan import ensure_wan_model
from stagemesh.services.dit.compile import (
    BlockCompiler,
    _embeddings,
    _image_payload,
    _video_payload,
    warm_up,
)
from stagemesh.services.dit.qwen_image_adapter import DenoiseAdapter, DenoiseInput
from stagemesh.services.dit.wan_adapter import WanDenoiseAdapter
from stagemesh.shared.engine.adapter import EngineRequest, StepBudget

#: compiled vs eager: inductor fuses and reorders float32 arithmetic, so the latents agree to
#: roundoff, not bit for bit.
ATOL = RTOL = 1e-4

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    """Each test compiles from scratch: dynamo keeps every compiler's graphs on the block
    class's code (the edit model shares Qwen-Image's), and past its recompile_limit (8) it would
    run the blocks eagerly without a word, which would make these checks vacuous."""
    torch._dynamo.reset()


def recompiles() -> float:
    return REGISTRY.get_sample_value("stagemesh_dit_recompiles_total") or 0.0


def denoise(adapter: DenoiseAdapter, size: int, rows: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Every request's latents after its steps: one request per (text length, negative length)
    of `rows` (a negative length > 0: guided), all in one batch."""
    dim = adapter.transformer.config["joint_attention_dim"]
    steps = adapter.limits.min_steps
    states = [adapter.prepare(EngineRequest(
        request_id=f"r{index}", budget=StepBudget(total_steps=steps),
        payload=DenoiseInput(embeddings=_embeddings(length, negative, False, dim), height=size,
                             width=size, num_inference_steps=steps,
                             true_cfg_scale=4.0 if negative else 1.0, seed=index)))
        for index, (length, negative) in enumerate(rows)]
    for _ in range(steps):
        adapter.step(states)
    return torch.cat([adapter.finish(state).latents for state in states])


def test_compiled_blocks_match_eager_and_do_not_recompile_after_warm_up() -> None:
    folder = ensure_model("tiny")
    eager, compiled = DenoiseAdapter(folder), DenoiseAdapter(folder)
    compiler = BlockCompiler()
    compiler.compile(compiled.transformer.transformer_blocks)
    warm_up(compiled, compiler)
    assert compiler.graphs > 0
    before = recompiles()

    mixed = [(9, 0), (4, 6), (12, 0), (3, 3)]  # guided and unguided rows, padded text
    torch.manual_seed(0)
    expected = denoise(eager, 64, mixed)
    torch.manual_seed(0)
    torch.testing.assert_close(denoise(compiled, 64, mixed), expected, atol=ATOL, rtol=RTOL)

    for size in (64, 128, 256):
        for batch in range(1, 9):
            denoise(compiled, size, [(2 + index, 0) for index in range(batch)])
    assert recompiles() == before


Adapter = DenoiseAdapter | WanDenoiseAdapter


def blocks(adapter: Adapter) -> list[torch.nn.Module]:
    if isinstance(adapter, WanDenoiseAdapter):
        return [block for t in adapter.transformers for block in t.blocks]
    return list(adapter.transformer.transformer_blocks)


def run_all(adapter: Any, payloads: Sequence[Any]) -> torch.Tensor:
    """One batch of `payloads` through all their steps: every request's latents."""
    states = [adapter.prepare(EngineRequest(
        request_id=f"r{index}", budget=StepBudget(total_steps=payload.num_inference_steps),
        payload=payload)) for index, payload in enumerate(payloads)]
    for _ in range(payloads[0].num_inference_steps):
        adapter.step(states)
    return torch.cat([adapter.finish(state).latents for state in states])


@pytest.mark.parametrize(("load", "payload"), [
    (lambda: DenoiseAdapter(ensure_edit_model()), _image_payload),
    (lambda: WanDenoiseAdapter(ensure_wan_model("t2v")), _video_payload),
], ids=["edit", "wan-t2v"])
def test_edit_and_wan_blocks_compile_match_eager_and_do_not_recompile(
    load: Callable[[], Adapter], payload: Callable[..., object],
) -> None:
    """Sizes and batches the warm-up did not run (96x64 and 64x96, one to three rows, guided
    and not) compile nothing more, and give eager's latents within roundoff."""
    eager, compiled = load(), load()
    compiler = BlockCompiler()
    compiler.compile(blocks(compiled))
    warm_up(compiled, compiler)
    assert compiler.graphs > 0
    before = recompiles()
    steps = max(compiled.limits.min_steps, 2)
    for height, width in ((96, 64), (64, 96)):
        for rows in ([(9, 0)], [(6, 6)], [(3, 0), (5, 0), (8, 0)]):
            torch.manual_seed(height)
            batch = [payload(eager, height, width, index, length, negative, False, steps)
                     for index, (length, negative) in enumerate(rows)]
            torch.testing.assert_close(run_all(compiled, batch), run_all(eager, batch),
                                       atol=ATOL, rtol=RTOL)
    assert recompiles() == before

