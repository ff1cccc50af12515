"""A Wan DiT over a group (services/dit/parallel.py) computes what one device computes.

Three module-scoped groups in turn over the tiny text-to-video model, one per layout (1 thread
a rank): `parallel_ulysses: 2` (each rank holds half of every forward's video tokens),
`parallel_cfg: 2` (conditional and unconditional rows on different ranks) and both (4 ranks).
Guided and unguided requests of different steps and seeds advancing together, and a lone
unguided request, match one device within 1e-5, with LoRA adapters too (rows with one, two,
none); with the step cache on, they reuse where one device reuses.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from stagemesh.launcher import Launcher
from stagemesh.services.dit.lora import LoraConfig, LoraUse
from stagemesh.services.dit.parallel import Degrees, WanFamily, running_group
from stagemesh.services.dit.step_cache import StepCache, StepCacheConfig, StepCacheMethod
from stagemesh.services.dit.wan_adapter import VideoDenoiseInput, WanDenoiseAdapter
from stagemesh.shared.engine import EngineRequest, InvalidInputError
from tests.model import test_dit_step_cache as step_cache_tests
from tests.model import test_dit_wan as one_device_wan
from tests.model import test_dit_wan_lora as wan_lora_tests
from tests.model.test_dit_step_cache import Triple
from tests.model.test_dit_wan import TOLERANCE, _embeddings, _run, _video

#: The layouts every test runs under (a group start each).
LAYOUTS = {"ulysses2": Degrees(ulysses=2), "cfg2": Degrees(cfg=2),
           "cfg2-ulysses2": Degrees(cfg=2, ulysses=2)}

#: The tiny text-to-video folder, as the Wan tests build it.
t2v_dir = one_device_wan.t2v_dir
#: Two seeded adapters of that transformer ("ink" rank 4, "wax" rank 2), as the Wan LoRA tests
#: write them.
lora_dir = wan_lora_tests.lora_dir
#: The step cache's committed decisions, and (autouse) the check that no one-device decision
#: lies within 1% of its threshold, as the step-cache tests have them.
mesh_decisions = step_cache_tests.mesh_decisions
clear_of_the_threshold = step_cache_tests.clear_of_the_threshold


def _loras(lora_dir: Path) -> LoraConfig:
    return LoraConfig(directory=lora_dir.resolve(), max_lora_rank=4)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def group(request: pytest.FixtureRequest, t2v_dir: Path, lora_dir: Path,
          group_launcher: Launcher) -> Iterator[WanDenoiseAdapter]:
    adapter = WanDenoiseAdapter(t2v_dir, lora=_loras(lora_dir))
    degrees = LAYOUTS[request.param]
    with running_group(WanFamily(adapter.transformers), t2v_dir, degrees,
                       launcher=group_launcher) as adapter.group:
        yield adapter


@pytest.fixture(scope="module")
def one_device(t2v_dir: Path, lora_dir: Path) -> WanDenoiseAdapter:
    return WanDenoiseAdapter(t2v_dir, lora=_loras(lora_dir))


def _together(adapter: WanDenoiseAdapter,
              payloads: dict[str, VideoDenoiseInput]) -> dict[str, torch.Tensor]:
    """Every request stepped in one batch until each finishes (finished ones leave it)."""
    live = {}
    for rid, payload in payloads.items():
        adapter.check_inputs(payload)
        live[rid] = adapter.prepare(EngineRequest(rid, payload))
    results = {}
    while live:
        outputs = adapter.step(list(live.values()))
        for rid, out in zip(list(live), outputs, strict=True):
            if out.finished:
                state = live.pop(rid)
                results[rid] = adapter.finish(state).latents
                adapter.release(state)
    return results


def test_a_video_group_equals_one_device(group: WanDenoiseAdapter,
                                         one_device: WanDenoiseAdapter) -> None:
    payloads = {
        "guided": _video(_embeddings(1)),
        "unguided": _video(_embeddings(2), guidance_scale=1.0, num_inference_steps=2,
                           seed=3),
        "guided-short": _video(_embeddings(3), num_inference_steps=3, seed=9),
    }
    assert group.group is not None
    if (ulysses := group.group.degrees.ulysses) > 1:
        # the ranks really share the tokens: diffusers' Ulysses attention is set on every block
        processors = [block.attn1.processor for block in group.transformers[0].blocks]
        assert all(p._parallel_config.context_parallel_config.ulysses_degree == ulysses
                   for p in processors)
    got = _together(group, payloads)
    for rid, payload in payloads.items():
        want = _run(one_device, payload).latents
        assert (got[rid] - want).abs().max().item() <= TOLERANCE, rid
    lone = replace(payloads["unguided"], seed=5)
    assert (_run(group, lone).latents - _run(one_device, lone).latents).abs().max() <= TOLERANCE


def test_video_rows_with_lora_adapters_equal_one_device(
        group: WanDenoiseAdapter, one_device: WanDenoiseAdapter) -> None:
    payloads = {
        "ink": _video(_embeddings(1), lora=(LoraUse("ink", 0.8),)),
        "both-unguided": _video(_embeddings(2), guidance_scale=1.0, num_inference_steps=2,
                                seed=3, lora=(LoraUse("ink", 1.2), LoraUse("wax", -0.7))),
        "none": _video(_embeddings(3), num_inference_steps=3, seed=9),
    }
    got = _together(group, payloads)
    for rid, payload in payloads.items():
        want = _run(one_device, payload).latents
        assert (got[rid] - want).abs().max().item() <= TOLERANCE, rid
    plain = _run(one_device, replace(payloads["ink"], lora=())).latents
    assert (got["ink"] - plain).abs().max().item() > 100 * TOLERANCE  # the adapter shows


def test_video_tokens_must_divide_among_ulysses_ranks(group: WanDenoiseAdapter) -> None:
    odd = _video(_embeddings(1), height=48)  # 3 x 3 x 3 tokens
    assert group.group is not None
    if group.group.degrees.ulysses == 1:
        group.check_inputs(odd)  # CFG-parallel alone splits rows, never tokens
        return
    with pytest.raises(InvalidInputError, match="parallel_ulysses"):
        group.check_inputs(odd)


def test_the_step_cache_decides_in_a_video_group_as_on_one_device(
        group: WanDenoiseAdapter, t2v_dir: Path, mesh_decisions: list[Triple],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """first_block over sharded video tokens: the same (step, branch, reused) as one device,
    and its latents within 1e-5 (the group's adapter takes the cache for this test: a group
    runs the transformers it was started with)."""
    config = StepCacheConfig(method=StepCacheMethod.FIRST_BLOCK, threshold=0.1,
                             max_threshold=1.0, max_skips=2)
    payloads = {
        "guided": _video(_embeddings(1), num_inference_steps=8),
        "unguided": _video(_embeddings(2), guidance_scale=1.0, num_inference_steps=6, seed=3),
    }
    want = _together(WanDenoiseAdapter(t2v_dir, step_cache=config), payloads)
    one_device = sorted(mesh_decisions)
    mesh_decisions.clear()
    monkeypatch.setattr(group, "step_cache", StepCache(config))
    got = _together(group, payloads)
    assert any(reused for *_, reused in one_device), "the threshold reuses nothing"
    assert sorted(mesh_decisions) == one_device
    for rid, latents in want.items():
        assert (got[rid] - latents).abs().max().item() <= TOLERANCE, rid
