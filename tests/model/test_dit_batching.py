"""Step batching in the DiT: one forward advances many requests, each as if it ran alone.

Also the mid-step abort: a bound StepInterrupt stops a forward between transformer blocks.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from diffusers import QwenImagePipeline
from prometheus_client import CollectorRegistry as Registry

from stagemesh.models import qwen_image
from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.services.dit.compile import BlockCompiler
from stagemesh.services.dit.qwen_image_adapter import DenoiseAdapter, DenoiseInput, DenoiseState
from stagemesh.services.dit.types import DenoisedLatents
from stagemesh.services.tokenizer.base import PromptInput
from stagemesh.services.tokenizer.qwen_image_adapter import PromptEncoderAdapter
from stagemesh.shared.engine import (
    Aborted,
    Completed,
    EngineMetrics,
    EngineRequest,
    Event,
    NoStream,
    Preempted,
    Progress,
    RequestStream,
    StepBudget,
    StepEngine,
    StepInterrupt,
    StepInterrupted,
    StepOutput,
)
from stagemesh.shared.quantization import Quantization, quantize

#: Batched rows may differ from solo rows by float rounding only.
TOLERANCE = 1e-5
SIZE = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return qwen_image.build_tiny_qwen_image(tmp_path_factory.mktemp("qwen-image") / "tiny")


@pytest.fixture(scope="module")
def encoder(model_dir: Path) -> PromptEncoderAdapter:
    return PromptEncoderAdapter(model_dir)


@pytest.fixture(scope="module")
def block_compiler() -> BlockCompiler:
    """One compiler for the module: its compiled block forward serves every fresh adapter."""
    return BlockCompiler()


@pytest.fixture
def dit(model_dir: Path, request: pytest.FixtureRequest) -> DenoiseAdapter:
    """A fresh adapter per test: interrupt hooks must not leak between tests. A test
    parametrized with `ACCELERATED` runs it also with int8 blocks and with compiled blocks."""
    adapter = DenoiseAdapter(model_dir)
    variant = getattr(request, "param", "eager")
    if variant == "int8":
        quantize(adapter.transformer.transformer_blocks, Quantization.INT8)
    elif variant == "compile":
        compiler: BlockCompiler = request.getfixturevalue("block_compiler")
        compiler.compile(adapter.transformer.transformer_blocks)
    return adapter


#: Abort, cancel-in-batch, preemption and interrupt hold with the stage's accelerations too.
ACCELERATED = pytest.mark.parametrize("dit", ["eager", "int8", "compile"], indirect=True)


def _embed(encoder: PromptEncoderAdapter, prompt: str, negative: str | None) -> PromptEmbeddings:
    state = encoder.prepare(EngineRequest(request_id="e", payload=PromptInput(prompt, negative)))
    encoder.step([state])
    embeddings = encoder.finish(state)
    encoder.release(state)
    return embeddings


def _padded(embeddings: PromptEmbeddings, extra: int) -> PromptEmbeddings:
    """The same prompt with `extra` trailing padding tokens hidden by a mask."""
    embeds = embeddings.prompt_embeds
    padded = torch.cat([embeds, torch.randn(1, extra, embeds.shape[2])], dim=1)
    mask = torch.ones(1, padded.shape[1], dtype=torch.long)
    mask[0, embeds.shape[1] :] = 0
    return replace(embeddings, prompt_embeds=padded, prompt_embeds_mask=mask)


@dataclass(frozen=True)
class Job:
    """A request and the tick at which it joins the running batch."""

    name: str
    payload: DenoiseInput
    arrives: int = 0


def _start(dit: DenoiseAdapter, job: Job) -> DenoiseState:
    dit.check_inputs(job.payload)
    return dit.prepare(EngineRequest(request_id=job.name, payload=job.payload))


def _solo(dit: DenoiseAdapter, job: Job) -> torch.Tensor:
    state = _start(dit, job)
    while True:
        (out,) = dit.step([state])
        if out.finished:
            return dit.finish(state).latents


def _continuous(dit: DenoiseAdapter, jobs: Sequence[Job]) -> dict[str, torch.Tensor]:
    """Continuous batching as the engine runs it: each tick, one `step` per image size over
    every live request; requests join at their arrival tick and leave when finished."""
    results: dict[str, torch.Tensor] = {}
    live: dict[str, DenoiseState] = {}
    tick = 0
    while len(results) < len(jobs):
        live |= {job.name: _start(dit, job) for job in jobs if job.arrives == tick}
        groups: dict[object, list[str]] = {}
        for name, state in live.items():
            groups.setdefault(dit.batch_key(state), []).append(name)
        for names in groups.values():
            outputs = dit.step([live[name] for name in names])
            for name, out in zip(names, outputs, strict=True):
                assert out.step_index == live[name].step_index
                if out.finished:
                    results[name] = dit.finish(live.pop(name)).latents
        tick += 1
    return results


def _assert_matches_solo(dit: DenoiseAdapter, jobs: Sequence[Job]) -> None:
    batched = _continuous(dit, jobs)
    solo = {job.name: _solo(dit, job) for job in jobs}
    for name, want in solo.items():
        assert batched[name].shape == want.shape
        assert (batched[name] - want).abs().max().item() <= TOLERANCE, name
    distinct = {tuple(latents.flatten()[:8].tolist()) for latents in solo.values()}
    assert len(distinct) == len(jobs)  # every job is its own work, not a copy of another


def test_mixed_requests_batched_equal_solo(
    encoder: PromptEncoderAdapter, dit: DenoiseAdapter
) -> None:
    short = _embed(encoder, "a cat", "")
    long = _embed(encoder, "a large blue square above a small red circle on a white floor", "dark")
    plain = _embed(encoder, "a green triangle", None)
    lengths = {
        short.prompt_embeds.shape[1],
        long.prompt_embeds.shape[1],
        plain.prompt_embeds.shape[1],
    }
    assert len(lengths) == 3  # prompts of different token lengths share the forward

    def job(
        name: str,
        emb: PromptEmbeddings,
        seed: int,
        *,
        arrives: int = 0,
        steps: int = 4,
        cfg: float = 4.0,
        sigmas: list[float] | None = None,
    ) -> Job:
        return Job(name, DenoiseInput(emb, SIZE, SIZE, steps, cfg, seed, sigmas), arrives)

    jobs = [
        job("guided-short", short, 1),
        job("guided-long", long, 11, steps=6),
        job("cfg-off", long, 5, cfg=1.0),
        job("no-negative", plain, 1, arrives=1, steps=3),
        job("sigmas", short, 7, arrives=2, sigmas=[1.0, 0.8, 0.5, 0.2]),
        job("masked-padding", _padded(plain, extra=5), 2, arrives=2, cfg=1.0),
        job("late", long, 99, arrives=5, steps=2, cfg=2.5),
    ]
    _assert_matches_solo(dit, jobs)


def test_sizes_batch_separately(encoder: PromptEncoderAdapter, dit: DenoiseAdapter) -> None:
    emb = _embed(encoder, "a red circle", "blurry")
    jobs = [
        Job("square-a", DenoiseInput(emb, SIZE, SIZE, 3, true_cfg_scale=4.0, seed=1)),
        Job("square-b", DenoiseInput(emb, SIZE, SIZE, 4, true_cfg_scale=1.0, seed=2)),
        Job("wide-a", DenoiseInput(emb, 32, 48, 3, true_cfg_scale=4.0, seed=3)),
        Job("wide-b", DenoiseInput(emb, 32, 48, 5, true_cfg_scale=4.0, seed=4), arrives=1),
    ]
    _assert_matches_solo(dit, jobs)


def test_padding_mask_hides_padding(encoder: PromptEncoderAdapter, dit: DenoiseAdapter) -> None:
    """A prompt padded with masked junk gives the same latents as the prompt alone."""
    emb = _embed(encoder, "a blue square", None)
    plain = Job("plain", DenoiseInput(emb, SIZE, SIZE, 3, true_cfg_scale=1.0, seed=0))
    padded = Job("padded", replace(plain.payload, embeddings=_padded(emb, extra=7)))
    assert (_solo(dit, plain) - _solo(dit, padded)).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize(("negative", "cfg"), [(None, 1.0), ("", 4.0), ("dark and blurry", 4.0)])
def test_solo_request_equals_pipeline_latents(
    model_dir: Path,
    encoder: PromptEncoderAdapter,
    dit: DenoiseAdapter,
    negative: str | None,
    cfg: float,
) -> None:
    """A guided request's cond and uncond rows share one forward; the pipeline runs two."""
    prompt, steps = "a yellow star in the middle", 4
    pipe = QwenImagePipeline.from_pretrained(model_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(
        prompt=prompt,
        negative_prompt=negative,
        true_cfg_scale=cfg,
        height=SIZE,
        width=SIZE,
        num_inference_steps=steps,
        generator=torch.Generator().manual_seed(3),
        output_type="latent",
    ).images
    emb = _embed(encoder, prompt, negative)
    job = Job("solo", DenoiseInput(emb, SIZE, SIZE, steps, true_cfg_scale=cfg, seed=3))
    got = _solo(dit, job)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= TOLERANCE


# -- mid-step abort -----------------------------------------------------------------------------


def _count_blocks(dit: DenoiseAdapter) -> list[int]:
    """A list that grows by one as each transformer block is entered (hooks run in the order
    they were registered, so this one runs after the adapter's interrupt check)."""
    entered: list[int] = []
    for index, block in enumerate(dit.transformer.transformer_blocks):
        block.register_forward_pre_hook(lambda module, args, index=index: entered.append(index))
    return entered


def _two_guided_states(encoder: PromptEncoderAdapter, dit: DenoiseAdapter) -> list[DenoiseState]:
    emb = _embed(encoder, "a red circle", "")
    return [
        _start(dit, Job(name, DenoiseInput(emb, SIZE, SIZE, 3, true_cfg_scale=4.0, seed=seed)))
        for name, seed in (("a", 1), ("b", 2))
    ]


def _armed(dit: DenoiseAdapter, *cancelled: str) -> StepInterrupt:
    """A StepInterrupt bound to `dit`, armed for the batch ("a", "b"), `cancelled` cancelled."""
    interrupt = StepInterrupt()
    dit.bind_interrupt(interrupt)
    interrupt.arm(["a", "b"])
    for request_id in cancelled:
        interrupt.cancel(request_id)
    return interrupt


@ACCELERATED
def test_cancelling_the_whole_batch_stops_the_forward_after_one_block(
    encoder: PromptEncoderAdapter, dit: DenoiseAdapter
) -> None:
    interrupt = _armed(dit)
    states = _two_guided_states(encoder, dit)
    before = [state.live().latents.clone() for state in states]
    entered = _count_blocks(dit)
    first_block = dit.transformer.transformer_blocks[0]

    def cancel_from_another_thread(module: torch.nn.Module, args: tuple[object, ...]) -> None:
        def cancel_both() -> None:
            for rid in ("a", "b"):
                interrupt.cancel(rid)

        canceller = threading.Thread(target=cancel_both)
        canceller.start()
        canceller.join()

    first_block.register_forward_pre_hook(cancel_from_another_thread)
    assert len(dit.transformer.transformer_blocks) > 1
    with pytest.raises(StepInterrupted):
        dit.step(states)
    assert entered == [0]  # the forward stopped before the second block
    for state, latents in zip(states, before, strict=True):  # nothing half-written
        assert state.step_index == 0
        assert torch.equal(state.live().latents, latents)


@ACCELERATED
def test_a_step_that_still_serves_someone_runs_to_its_end(
    encoder: PromptEncoderAdapter, dit: DenoiseAdapter
) -> None:
    _armed(dit, "a")
    states = _two_guided_states(encoder, dit)
    entered = _count_blocks(dit)
    outputs = dit.step(states)
    assert [out.step_index for out in outputs] == [1, 1]
    assert entered == list(range(len(dit.transformer.transformer_blocks)))


@ACCELERATED
def test_an_interrupted_state_steps_on_as_if_never_interrupted(
    encoder: PromptEncoderAdapter, dit: DenoiseAdapter
) -> None:
    interrupt = _armed(dit, "a", "b")
    states = _two_guided_states(encoder, dit)
    with pytest.raises(StepInterrupted):
        dit.step(states)
    interrupt.disarm()
    while not all(out.finished for out in dit.step(states)):
        pass
    reference = _two_guided_states(encoder, dit)
    while not all(out.finished for out in dit.step(reference)):
        pass
    for state, want in zip(states, reference, strict=True):
        assert torch.equal(state.live().latents, want.live().latents)


@ACCELERATED
def test_binding_again_replaces_the_hooks(
    encoder: PromptEncoderAdapter, dit: DenoiseAdapter
) -> None:
    _armed(dit, "a", "b")  # bound, then replaced by the next binding
    current = _armed(dit)
    states = _two_guided_states(encoder, dit)
    assert [out.step_index for out in dit.step(states)] == [1, 1]  # the stale one is unhooked
    current.cancel("a")
    current.cancel("b")
    with pytest.raises(StepInterrupted):
        dit.step(states)


def test_a_failing_scheduler_step_fails_its_own_state_only(
    encoder: PromptEncoderAdapter, dit: DenoiseAdapter
) -> None:
    states = _two_guided_states(encoder, dit)
    broken = states[0].live().scheduler

    def fail(*args: object, **kwargs: object) -> object:
        raise RuntimeError("boom")

    broken.step = fail  # type: ignore[method-assign,assignment]
    first, second = dit.step(states)
    assert first.step_index == 0 and first.error is not None and "boom" in first.error
    assert second.step_index == 1 and second.error is None
    assert states[0].step_index == 0


# -- through the engine -------------------------------------------------------------------------


async def _run_in_engine(
    engine: StepEngine[DenoiseInput, NoStream, DenoiseState, NoStream, DenoisedLatents],
    jobs: Sequence[Job],
) -> dict[str, Event[NoStream, DenoisedLatents]]:
    """Submit every job before the engine starts (so the first tick sees them all) and return
    each one's terminal event."""
    streams = {
        job.name: engine.submit(
            EngineRequest(job.name, job.payload, StepBudget(job.payload.num_inference_steps))
        )
        for job in jobs
    }
    engine.start()
    terminal: dict[str, Event[NoStream, DenoisedLatents]] = {}
    try:
        for name, stream in streams.items():
            async for event in stream:
                terminal[name] = event
    finally:
        await asyncio.to_thread(engine.shutdown, True, 10)
    return terminal


async def test_the_engine_batches_dit_requests_of_one_size(
    encoder: PromptEncoderAdapter, dit: DenoiseAdapter
) -> None:
    emb = _embed(encoder, "a red circle", "")
    other = _embed(encoder, "two small green squares side by side", None)
    jobs = [
        Job(f"square-{i}", DenoiseInput(emb if i % 2 else other, SIZE, SIZE, 3 + i, 4.0, i))
        for i in range(4)
    ] + [Job(f"wide-{i}", DenoiseInput(emb, 32, 48, 3, 4.0, 10 + i)) for i in range(2)]
    calls: list[list[tuple[int, int]]] = []
    step = dit.step

    def recording_step(states: Sequence[DenoiseState]) -> list[StepOutput[NoStream]]:
        calls.append([(state.plan.height, state.plan.width) for state in states])
        return step(states)

    dit.step = recording_step  # type: ignore[method-assign]
    engine = StepEngine(dit, max_running=16, max_batch=4, metrics=EngineMetrics("dit", Registry()))
    terminal = await _run_in_engine(engine, jobs)
    dit.step = step  # type: ignore[method-assign]
    for job in jobs:
        event = terminal[job.name]
        assert isinstance(event, Completed), event
        want = _solo(dit, job)
        assert (event.result.latents - want).abs().max().item() <= TOLERANCE, job.name
    assert all(len(set(sizes)) == 1 and len(sizes) <= 4 for sizes in calls)
    assert max(len(sizes) for sizes in calls) == 4  # a full batch ran as one forward


@ACCELERATED
async def test_an_abort_stops_the_dit_forward_between_blocks(
    encoder: PromptEncoderAdapter, dit: DenoiseAdapter
) -> None:
    """engine.abort() reaches the forward in flight: the next block does not run."""
    registry = Registry()
    engine = StepEngine(dit, max_running=4, max_batch=4, metrics=EngineMetrics("dit", registry))
    emb = _embed(encoder, "a red circle", "")
    job = Job("doomed", DenoiseInput(emb, SIZE, SIZE, 50, 4.0, 0))
    entered = _count_blocks(dit)
    first_block = dit.transformer.transformer_blocks[0]

    def abort_in_the_second_step(module: torch.nn.Module, args: tuple[object, ...]) -> None:
        if entered.count(0) == 2:  # the counting hook ran first for this block
            engine.abort("doomed")

    first_block.register_forward_pre_hook(abort_in_the_second_step)
    terminal = await _run_in_engine(engine, [job])
    event = terminal["doomed"]
    assert isinstance(event, Aborted), event
    assert event.step_index == 1  # the second step never completed
    blocks = len(dit.transformer.transformer_blocks)
    assert entered == [*range(blocks), 0]  # stopped before the second block of step 2
    interrupts = registry.get_sample_value("stagemesh_forward_interrupts_total", {"stage": "dit"})
    assert interrupts == 1


@ACCELERATED
async def test_a_member_cancelled_mid_batch_leaves_the_others_unchanged(
    encoder: PromptEncoderAdapter, dit: DenoiseAdapter
) -> None:
    """Three requests share every forward; one is cancelled while the second step runs. That
    step's output is dropped for it (a cancel during a step wins over its output), it leaves the
    batch at the boundary, and the other two give exactly what they give alone."""
    emb = _embed(encoder, "a red circle", "")
    other = _embed(encoder, "two small green squares side by side", "")
    jobs = [Job(name, DenoiseInput(e, SIZE, SIZE, 5, 4.0, seed))
            for name, e, seed in (("a", emb, 1), ("b", other, 2), ("c", emb, 3))]
    engine = StepEngine(dit, max_running=4, max_batch=4, metrics=EngineMetrics("dit", Registry()))
    calls: list[int] = []
    step = dit.step

    def cancel_b_after_two_steps(states: Sequence[DenoiseState]) -> list[StepOutput[NoStream]]:
        outputs = step(states)
        calls.append(len(states))
        if len(calls) == 2:
            engine.abort("b")
        return outputs

    dit.step = cancel_b_after_two_steps  # type: ignore[method-assign]
    terminal = await _run_in_engine(engine, jobs)
    dit.step = step  # type: ignore[method-assign]
    cancelled = terminal["b"]
    assert isinstance(cancelled, Aborted) and cancelled.step_index == 1, cancelled
    assert calls[:2] == [3, 3] and set(calls[2:]) == {2}  # b ran in the batch, then left it
    for job in (jobs[0], jobs[2]):
        event = terminal[job.name]
        assert isinstance(event, Completed), event
        assert (event.result.latents - _solo(dit, job)).abs().max().item() <= TOLERANCE


@ACCELERATED
async def test_a_preempted_request_resumes_and_gives_the_same_latents(
    encoder: PromptEncoderAdapter, dit: DenoiseAdapter
) -> None:
    """With room to run one request, an urgent arrival preempts the running one at a step
    boundary; the preempted request keeps its state, resumes, and ends where it would have
    ended alone (its stream said it was preempted)."""
    emb = _embed(encoder, "a red circle", "")
    low = Job("low", DenoiseInput(emb, SIZE, SIZE, 6, 4.0, 1))
    urgent = Job("urgent", DenoiseInput(emb, SIZE, SIZE, 3, 4.0, 2))
    engine = StepEngine(dit, max_running=2, max_batch=1, metrics=EngineMetrics("dit", Registry()))
    engine.start()
    events: list[Event[NoStream, DenoisedLatents]] = []
    try:
        low_stream = engine.submit(EngineRequest("low", low.payload, StepBudget(6), priority=5))
        urgent_stream = None
        async for event in low_stream:
            events.append(event)
            if isinstance(event, Progress) and event.step_index == 2 and urgent_stream is None:
                urgent_stream = engine.submit(
                    EngineRequest("urgent", urgent.payload, StepBudget(3), priority=0))
        assert urgent_stream is not None
        urgent_events = [event async for event in urgent_stream]
    finally:
        await asyncio.to_thread(engine.shutdown, True, 10)
    preempted = [event for event in events if isinstance(event, Preempted)]
    assert len(preempted) == 1 and 2 <= preempted[0].step_index < 6, events
    finished, urgent_done = events[-1], urgent_events[-1]
    assert isinstance(finished, Completed) and isinstance(urgent_done, Completed)
    assert (finished.result.latents - _solo(dit, low)).abs().max().item() <= TOLERANCE
    assert (urgent_done.result.latents - _solo(dit, urgent)).abs().max().item() <= TOLERANCE


async def _until_done(stream: RequestStream[NoStream, DenoisedLatents]) -> None:
    events = [event async for event in stream]
    assert isinstance(events[-1], Completed), events


async def test_an_idle_dit_starts_a_burst_in_one_forward_and_a_lone_request_after_the_window(
    encoder: PromptEncoderAdapter, dit: DenoiseAdapter
) -> None:
    """Batch forming through the engine: requests sent a few ms apart to an idle stage share
    its first forward; a lone request is held for the window, then the engine wakes itself."""
    window = 0.3
    payload = DenoiseInput(_embed(encoder, "a red circle", ""), SIZE, SIZE, 2, 4.0, 0)
    calls: list[tuple[float, int]] = []  # (when, states) of every step call
    step = dit.step

    def recording_step(states: Sequence[DenoiseState]) -> list[StepOutput[NoStream]]:
        calls.append((time.monotonic(), len(states)))
        return step(states)

    dit.step = recording_step  # type: ignore[method-assign]
    engine = StepEngine(dit, max_running=8, admission_window=window,
                        metrics=EngineMetrics("dit", Registry()))
    engine.start()
    try:
        burst = []
        for i in range(3):
            burst.append(engine.submit(EngineRequest(f"burst-{i}", payload, StepBudget(2))))
            await asyncio.sleep(0.01)
        for stream in burst:
            await _until_done(stream)
        assert [states for _, states in calls] == [3, 3]  # never one running ahead alone
        calls.clear()
        sent = time.monotonic()
        await _until_done(engine.submit(EngineRequest("lone", payload, StepBudget(2))))
    finally:
        await asyncio.to_thread(engine.shutdown, True, 10)
        dit.step = step  # type: ignore[method-assign]
    held = calls[0][0] - sent
    assert window <= held < window + 2.0, held  # held no longer than the window (plus a tick)
