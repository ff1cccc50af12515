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

import asyncio
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
from prometheus_client import REGISTRY, CollectorRegistry

from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.models.registry import resolve_model
from stagemesh.services.dit import step_cache
from stagemesh.services.dit.forward import Branch, RowMeta, qwen_image_forward, wan_forward
from stagemesh.services.dit.qwen_image_adapter import DenoiseAdapter, DenoiseInput, DenoiseState
from stagemesh.services.dit.step_cache import (
    Slot,
    StepCache,
    StepCacheConfig,
    StepCacheMethod,
)
from stagemesh.services.dit.wan_adapter import VideoDenoiseInput, WanDenoiseAdapter
from stagemesh.shared.engine import (
    Aborted,
    Completed,
    EngineMetrics,
    EngineRequest,
    InvalidInputError,
    NoStream,
    Progress,
    StepBudget,
    StepEngine,
    StepInterrupt,
    StepInterrupted,
    StepOutput,
)
from stagemesh.shared.proto.v1 import dit_service_pb2

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


# -- rows stay rows with the cache on (qwen-image-tiny: two blocks, a head and a tail) ---------

TINY_THRESHOLD, TINY_STEPS, TINY_SIZE = 0.5, 10, 32


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return resolve_model("builtin:qwen-image-tiny")


@pytest.fixture
def cached(tiny_dir: Path) -> DenoiseAdapter:
    """A fresh adapter per test (interrupt hooks and cache accounting must not leak)."""
    return DenoiseAdapter(tiny_dir, step_cache=_fbc(TINY_THRESHOLD))


@pytest.fixture(autouse=True)
def clear_of_the_threshold(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every relative change the mesh compares lies more than 1% away from the row's
    threshold, so that no decision depends on who else shares the forward."""
    compare = step_cache._relative_changes

    def checked(residuals: torch.Tensor, slots: Sequence[Slot], rows: Sequence[int]) -> list[float]:
        changes = compare(residuals, slots, rows)
        for i, change in zip(rows, changes, strict=True):
            cache = slots[i].cache
            assert cache is not None
            assert abs(change - cache.threshold) > MARGIN * cache.threshold, change
        return changes

    monkeypatch.setattr(step_cache, "_relative_changes", checked)
    yield


def _tiny(seed: int, steps: int = TINY_STEPS, **fields: Any) -> DenoiseInput:
    generator = torch.Generator().manual_seed(seed)
    emb = PromptEmbeddings(
        torch.randn(1, 6 + seed, 32, generator=generator), None,
        torch.randn(1, 4, 32, generator=generator), None,
    )  # fmt: skip
    return replace(DenoiseInput(emb, TINY_SIZE, TINY_SIZE, steps, 4.0, seed), **fields)


def _start(dit: DenoiseAdapter, name: str, payload: DenoiseInput) -> DenoiseState:
    dit.check_inputs(payload)
    return dit.prepare(EngineRequest(request_id=name, payload=payload))


def _drive(
    dit: DenoiseAdapter,
    payloads: dict[str, DenoiseInput],
    pick: Callable[[int, dict[str, DenoiseState]], list[str]],
) -> tuple[dict[str, torch.Tensor], dict[str, list[bool]]]:
    """Step the requests in batches `pick(tick, live)` chooses until each finishes or leaves
    (pick drops it: released as the engine releases a cancelled request); each one's latents
    and per-step `reused`."""
    live = {name: _start(dit, name, payload) for name, payload in payloads.items()}
    results: dict[str, torch.Tensor] = {}
    reused: dict[str, list[bool]] = {name: [] for name in payloads}
    tick = 0
    while live:
        chosen = pick(tick, live)
        for name in [n for n in live if n not in chosen and n == "cancelled"]:
            dit.release(live.pop(name))
        batch = [name for name in chosen if name in live]
        outputs = dit.step([live[name] for name in batch])
        for name, out in zip(batch, outputs, strict=True):
            assert out.error is None
            reused[name].append(out.reused)
            if out.finished:
                results[name] = dit.finish(live[name]).latents
                dit.release(live.pop(name))
        tick += 1
    return results, reused


def _alone(dit: DenoiseAdapter, payload: DenoiseInput) -> tuple[torch.Tensor, list[bool]]:
    results, reused = _drive(dit, {"r": payload}, lambda tick, live: list(live))
    return results["r"], reused["r"]


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (got - want).abs().max().item() <= TOLERANCE


def test_cache_off_is_the_transformer_bit_for_bit(tiny_dir: Path, t2v_dir: Path) -> None:
    """Our block loop without hooks is diffusers' forward exactly; a cached stage with the
    request's cache off (threshold 0) gives what a stage without a cache gives, bit for bit."""
    off = DenoiseAdapter(tiny_dir)
    transformer = off.transformer
    generator = torch.Generator().manual_seed(0)
    hidden, text = torch.randn(2, 16, 64, generator=generator), torch.randn(2, 5, 32)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    shapes = [[(1, 4, 4)]] * 2
    rows = [RowMeta("a", Branch.COND), RowMeta("a", Branch.UNCOND)]
    with torch.inference_mode():
        want = transformer(hidden_states=hidden, encoder_hidden_states=text,
                           encoder_hidden_states_mask=mask, timestep=torch.tensor([0.9, 0.5]),
                           img_shapes=shapes, return_dict=False)[0]
        got = qwen_image_forward(transformer, hidden_states=hidden, encoder_hidden_states=text,
                                 encoder_hidden_states_mask=mask,
                                 timestep=torch.tensor([0.9, 0.5]), img_shapes=shapes, rows=rows)
    assert torch.equal(got, want)
    wan_dit = WanDenoiseAdapter(t2v_dir).transformers[0]
    video, embeds = torch.randn(2, 16, 3, 4, 6, generator=generator), torch.randn(2, 512, 32)
    with torch.inference_mode():
        want = wan_dit(hidden_states=video, timestep=torch.tensor([999.0, 500.0]),
                       encoder_hidden_states=embeds, return_dict=False)[0]
        got = wan_forward(wan_dit, hidden_states=video, timestep=torch.tensor([999.0, 500.0]),
                          encoder_hidden_states=embeds, rows=rows)
    assert torch.equal(got, want)
    payload = _tiny(1)
    plain, _ = _alone(off, payload)
    cached = DenoiseAdapter(tiny_dir, step_cache=_fbc(TINY_THRESHOLD))
    request_off, reused = _alone(cached, replace(payload, step_cache_threshold=0.0))
    assert torch.equal(request_off, plain) and not any(reused)
    assert cached.step_cache.held_bytes == 0


def test_a_cancelled_batch_mate_leaves_the_others_unchanged(cached: DenoiseAdapter) -> None:
    payloads = {"a": _tiny(1), "cancelled": _tiny(2), "c": _tiny(3)}
    alone = {name: _alone(cached, payload) for name, payload in payloads.items()}
    assert all(any(reused) for _, reused in alone.values()), "the threshold reuses nothing"

    def cancel_at_tick_4(tick: int, live: dict[str, DenoiseState]) -> list[str]:
        return [name for name in live if tick < 4 or name != "cancelled"]

    results, reused = _drive(cached, payloads, cancel_at_tick_4)
    assert set(results) == {"a", "c"}
    for name in ("a", "c"):
        assert reused[name] == alone[name][1]
        assert _close(results[name], alone[name][0])
    assert cached.step_cache.held_bytes == 0


def test_preempted_and_resumed_equals_never_preempted(cached: DenoiseAdapter) -> None:
    """"a" is paused for three steps while "b" runs on (as the engine preempts it): its cache
    stays as it was, and it ends exactly as if it had never been paused."""
    payloads = {"a": _tiny(1), "b": _tiny(3)}
    alone = {name: _alone(cached, payload) for name, payload in payloads.items()}
    held: list[int] = []

    def pause_a(tick: int, live: dict[str, DenoiseState]) -> list[str]:
        if "a" in live and live["a"].cache is not None:
            held.append(live["a"].cache.nbytes())
        return [name for name in live if not (name == "a" and 3 <= tick < 6)]

    results, reused = _drive(cached, payloads, pause_a)
    assert held[3] == held[4] == held[5] == held[6] > 0  # kept while paused
    for name in payloads:
        assert reused[name] == alone[name][1]
        assert _close(results[name], alone[name][0])


def test_a_block_interrupt_stops_a_cached_forward(cached: DenoiseAdapter) -> None:
    """Every row cancelled during the head block: the forward stops before the tail block
    (its interrupt check runs after the rows were chosen); no row has advanced nor changed its
    cache, and stepping on gives what an uninterrupted run gives."""
    payload = _tiny(1)
    want, _ = _alone(cached, payload)
    state = _start(cached, "a", payload)
    cached.step([state])
    cached.step([state])  # step 2 runs in full (see the reuse pattern of seed 1)
    interrupt = StepInterrupt()
    cached.bind_interrupt(interrupt)
    interrupt.arm(["a"])
    head = cached.transformer.transformer_blocks[0]  # its own check has passed by then
    hook = head.register_forward_pre_hook(lambda module, args: interrupt.cancel("a"))
    assert state.cache is not None
    before = {branch: entry.head for branch, entry in state.cache.branches.items()}
    held = cached.step_cache.held_bytes
    with pytest.raises(StepInterrupted):
        cached.step([state])
    hook.remove()
    interrupt.disarm()
    assert state.step_index == 2 and cached.step_cache.held_bytes == held > 0
    assert all(state.cache.branches[b].head is head for b, head in before.items())
    while not cached.step([state])[0].finished:
        pass
    assert _close(cached.finish(state).latents, want)


async def test_an_aborted_rows_cache_is_freed(cached: DenoiseAdapter) -> None:
    """The stage's accounting of cached bytes goes back to zero once an aborted request and
    its finished batch mate have left; while they ran it was not zero."""
    engine = StepEngine(cached, max_running=2, max_batch=2,
                        metrics=EngineMetrics("dit", CollectorRegistry()))
    held: list[int] = []
    step = cached.step

    def abort_doomed_at_step_3(states: Sequence[DenoiseState]) -> list[StepOutput[NoStream]]:
        outputs = step(states)
        held.append(cached.step_cache.held_bytes)
        if len(held) == 3:
            engine.abort("doomed")
        return outputs

    cached.step = abort_doomed_at_step_3  # type: ignore[method-assign]
    streams = {
        name: engine.submit(EngineRequest(name, payload, StepBudget(payload.num_inference_steps)))
        for name, payload in (("doomed", _tiny(2)), ("kept", _tiny(1)))
    }
    engine.start()
    terminal: dict[str, object] = {}
    reused: list[bool] = []
    try:
        for name, stream in streams.items():
            async for event in stream:
                terminal[name] = event
                if name == "kept" and isinstance(event, Progress):
                    reused.append(event.reused)
    finally:
        await asyncio.to_thread(engine.shutdown, True, 10)
    assert isinstance(terminal["doomed"], Aborted)
    assert isinstance(terminal["kept"], Completed)
    assert held[2] > held[-1] > 0  # two rows' caches, then one
    assert cached.step_cache.held_bytes == 0
    assert any(reused) and not all(reused)  # Progress says which steps reused


# -- the schedule, Wan 2.2's switch of transformer, the per-request threshold --------------------


def test_taylorseer_forecasts_on_its_schedule(tiny_dir: Path) -> None:
    """diffusers' schedule: warm-up steps 0-1, then a full pass when (step - 2 - 1) % 3 == 0,
    the final step in full; a forecast is the linear extrapolation of the last two passes."""
    config = StepCacheConfig(method=StepCacheMethod.TAYLORSEER, threshold=0.05, interval=3,
                             warmup_steps=2, final_steps=1, max_skips=0)
    dit = DenoiseAdapter(tiny_dir, step_cache=config)
    _, reused = _alone(dit, _tiny(1))
    assert [step for step, r in enumerate(reused) if r] == [2, 4, 5, 7, 8]
    assert dit.step_cache.held_bytes == 0
    bounded = DenoiseAdapter(tiny_dir, step_cache=replace(config, max_skips=1))
    _, reused = _alone(bounded, _tiny(1))
    assert [step for step, r in enumerate(reused) if r] == [2, 4, 7]


def test_a_wan_row_starts_its_cache_anew_on_the_second_transformer(
    mesh_decisions: list[Triple],
) -> None:
    """With a threshold that reuses every step it may, the first step on transformer_2
    (timestep 833 of 999, 961, 909 | 833, 714, 500) still runs in full."""
    i2v = WanDenoiseAdapter(resolve_model("builtin:wan-i2v-tiny"), step_cache=_fbc(1.0))
    condition = torch.zeros(1, 16, 3, WAN_HEIGHT // 8, WAN_WIDTH // 8)
    payload = VideoDenoiseInput(_wan_embeddings(3), WAN_HEIGHT, WAN_WIDTH, WAN_FRAMES, 6, 1.0,
                                7, condition_latents=(condition,))
    _solo(i2v, payload)
    assert sorted(mesh_decisions) == [(step, "cond", step not in (0, 3)) for step in range(6)]


@pytest.mark.parametrize(
    ("config", "asked", "message"),
    [
        (StepCacheConfig(), 0.1, "at most 0.0"),
        (_fbc(0.3), 1.5, "at most 1.0"),
        (_fbc(0.3), -0.1, ">= 0"),
        (StepCacheConfig(method=StepCacheMethod.TAYLORSEER, threshold=0.2), 0.3, "0 \\(off\\)"),
    ],
)
def test_the_request_threshold_is_checked(
    tiny_dir: Path, config: StepCacheConfig, asked: float, message: str
) -> None:
    dit = DenoiseAdapter(tiny_dir, step_cache=config)
    with pytest.raises(InvalidInputError, match=message) as caught:
        dit.check_inputs(_tiny(1, step_cache_threshold=asked))
    assert caught.value.field_name == "step_cache_threshold"
    dit.check_inputs(_tiny(1, step_cache_threshold=0.0))  # off is always allowed


def test_a_threshold_at_the_maximum_is_taken_after_the_float32_wire() -> None:
    """A proto float carries 0.2 as 0.20000000298...: still the stage's maximum, and still a
    taylorseer stage's own setting."""
    on_the_wire = dit_service_pb2.DenoiseStart(step_cache_threshold=0.2)
    first_block = StepCacheConfig(method=StepCacheMethod.FIRST_BLOCK, max_threshold=0.2)
    assert first_block.request_threshold(on_the_wire.step_cache_threshold) == pytest.approx(0.2)
    taylorseer = StepCacheConfig(method=StepCacheMethod.TAYLORSEER, threshold=0.2)
    assert taylorseer.request_threshold(on_the_wire.step_cache_threshold) == 0.2


def test_rows_are_counted_by_pass(cached: DenoiseAdapter) -> None:
    """stagemesh_dit_rows_total{pass}: one row per (step, branch), full or reused."""

    def count(kind: str) -> float:
        return REGISTRY.get_sample_value("stagemesh_dit_rows_total", {"pass": kind}) or 0.0

    before = {kind: count(kind) for kind in ("full", "reused")}
    _, reused = _alone(cached, _tiny(1))
    full, skipped = count("full") - before["full"], count("reused") - before["reused"]
    assert full + skipped == 2 * TINY_STEPS  # guided: two branches a step
    assert skipped >= 2 * sum(reused) > 0  # a step is reused when both branches are
