"""The DiT stage on Wan video models: the stock pipelines' latents, step by step.

WanDenoiseAdapter must give `WanPipeline` / `WanImageToVideoPipeline(output_type="latent")`'s
latents for the same embeddings, seed and condition (within float rounding: a guided step runs
its conditional and unconditional rows in one forward), stop at a step boundary when aborted,
switch transformers at the boundary, batch requests as if each ran alone, and refuse what the
model does not take with INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline
from diffusers.schedulers.scheduling_unipc_multistep import UniPCMultistepScheduler
from prometheus_client import CollectorRegistry as Registry

from stagemesh.models import wan
from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.models.families.wan import PROMPT_MAX_TOKENS
from stagemesh.models.qwen_image import seeded
from stagemesh.services.dit import servicer
from stagemesh.services.dit.preview import PreviewOptions
from stagemesh.services.dit.preview_decode import PainterChoice
from stagemesh.services.dit.types import DenoisedLatents
from stagemesh.services.dit.wan_adapter import (
    VideoDenoiseInput,
    WanDenoiseAdapter,
)
from stagemesh.services.registry import build_stage
from stagemesh.shared.engine import (
    Aborted,
    Completed,
    EngineMetrics,
    EngineRequest,
    Event,
    InvalidInputError,
    NoStream,
    StepBudget,
    StepEngine,
)
from stagemesh.shared.engine.adapter import ExecutionMode
from stagemesh.shared.errors import parse_rpc_error
from stagemesh.shared.proto.v1 import dit_service_pb2 as pb
from stagemesh.shared.proto.v1 import dit_service_pb2_grpc
from stagemesh.shared.stage_runtime import start_stage, stop_stage
from stagemesh.shared.torch_tensors import optional_to_proto, to_proto

TOLERANCE = 1e-5
HEIGHT, WIDTH, FRAMES = 32, 48, 9  # latents [1, 16, 3, 4, 6]


@pytest.fixture(scope="module")
def t2v_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wan.build_tiny_wan(tmp_path_factory.mktemp("wan") / "t2v", variant="t2v")


@pytest.fixture(scope="module")
def i2v_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return wan.build_tiny_wan(tmp_path_factory.mktemp("wan") / "i2v", variant="i2v")


@pytest.fixture
def t2v(t2v_dir: Path) -> WanDenoiseAdapter:
    """A fresh adapter per test: interrupt hooks must not leak between tests."""
    return WanDenoiseAdapter(t2v_dir)


@pytest.fixture
def i2v(i2v_dir: Path) -> WanDenoiseAdapter:
    return WanDenoiseAdapter(i2v_dir)


def _embeddings(seed: int = 0, tokens: int = PROMPT_MAX_TOKENS) -> PromptEmbeddings:
    """Prompt and negative embeddings shaped as the pipelines make them (zero-padded)."""
    generator = torch.Generator().manual_seed(seed)
    prompt, negative = torch.zeros(2, 1, tokens, 32)
    prompt[:, :7] = torch.randn(1, 7, 32, generator=generator)
    negative[:, :3] = torch.randn(1, 3, 32, generator=generator)
    return PromptEmbeddings(prompt, None, negative, None)


def _condition(pipe: WanImageToVideoPipeline, image: torch.Tensor) -> torch.Tensor:
    """What the VAE stage's EncodeImage sends: the pipeline's normalized condition latents
    (its `prepare_latents` without the mask channels it puts in front)."""
    shape = (1, 16, 3, HEIGHT // 8, WIDTH // 8)
    pixels = pipe.video_processor.preprocess(image, height=HEIGHT, width=WIDTH)
    _, condition = pipe.prepare_latents(
        pixels, 1, 16, HEIGHT, WIDTH, FRAMES, torch.float32, torch.device("cpu"),
        latents=torch.zeros(shape),
    )
    mask_channels = pipe.vae_scale_factor_temporal
    return condition[:, mask_channels:]


def _run(adapter: WanDenoiseAdapter, payload: VideoDenoiseInput) -> DenoisedLatents:
    adapter.check_inputs(payload)
    state = adapter.prepare(EngineRequest("r", payload))
    while not adapter.step([state])[0].finished:
        pass
    result = adapter.finish(state)
    adapter.release(state)
    return result


def _video(embeddings: PromptEmbeddings, **fields: Any) -> VideoDenoiseInput:
    payload = VideoDenoiseInput(embeddings, HEIGHT, WIDTH, FRAMES, 4, 5.0, 7)
    return replace(payload, **fields)


@pytest.mark.parametrize("flow_shift", [None, 5.0])
def test_text_to_video_equals_the_pipeline(
    t2v_dir: Path, t2v: WanDenoiseAdapter, flow_shift: float | None
) -> None:
    emb = _embeddings()
    pipe = WanPipeline.from_pretrained(t2v_dir)
    if flow_shift is not None:  # how a diffusers user sets it
        pipe.scheduler = UniPCMultistepScheduler.from_config(
            pipe.scheduler.config, flow_shift=flow_shift
        )
    want = pipe(
        prompt_embeds=emb.prompt_embeds, negative_prompt_embeds=emb.negative_prompt_embeds,
        height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=4,
        guidance_scale=5.0, generator=torch.Generator("cpu").manual_seed(7),
        output_type="latent",
    ).frames
    got = _run(t2v, _video(emb, flow_shift=flow_shift))
    assert got.latents.shape == want.shape == (1, 16, 3, 4, 6)
    assert got.latents.dtype == torch.float32
    assert (got.latents - want).abs().max().item() <= TOLERANCE
    assert (got.num_frames, got.height, got.width) == (FRAMES, HEIGHT, WIDTH)


@pytest.mark.parametrize(
    ("guidance_scale_2", "boundary_ratio"), [(None, None), (2.0, None), (1.5, 0.5)]
)
def test_image_to_video_equals_the_pipeline(
    i2v_dir: Path, i2v: WanDenoiseAdapter, guidance_scale_2: float | None,
    boundary_ratio: float | None,
) -> None:
    """Both transformers run (the folder's boundary 0.9 splits 6 steps 3/3), each with its
    own guidance scale; a request's boundary_ratio moves the split like the pipeline's."""
    emb = _embeddings(1)
    pipe = WanImageToVideoPipeline.from_pretrained(i2v_dir)
    if boundary_ratio is not None:
        pipe.register_to_config(boundary_ratio=boundary_ratio)
    image = torch.rand(1, 3, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(2))
    want = pipe(
        image=image, prompt_embeds=emb.prompt_embeds,
        negative_prompt_embeds=emb.negative_prompt_embeds, height=HEIGHT, width=WIDTH,
        num_frames=FRAMES, num_inference_steps=6, guidance_scale=4.0,
        guidance_scale_2=guidance_scale_2, generator=torch.Generator("cpu").manual_seed(3),
        output_type="latent",
    ).frames
    payload = _video(
        emb, num_inference_steps=6, guidance_scale=4.0, seed=3,
        condition_latents=(_condition(pipe, image),), guidance_scale_2=guidance_scale_2,
        boundary_ratio=boundary_ratio,
    )
    got = _run(i2v, payload)
    assert (got.latents - want).abs().max().item() <= TOLERANCE


def test_the_boundary_picks_the_transformer(i2v: WanDenoiseAdapter) -> None:
    """Timesteps at or above boundary_ratio * 1000 run `transformer`, the rest `transformer_2`."""
    calls: list[int] = []
    for index, transformer in enumerate(i2v.transformers):
        # the patch embedding runs once per forward of its transformer (our block loop calls
        # the transformer's modules, not its `forward`)
        transformer.patch_embedding.register_forward_pre_hook(
            lambda m, a, index=index: calls.append(index)
        )
    condition = torch.zeros(1, 16, 3, HEIGHT // 8, WIDTH // 8)
    _run(i2v, _video(_embeddings(), num_inference_steps=6, guidance_scale=1.0,
                     condition_latents=(condition,)))
    assert calls == [0, 0, 0, 1, 1, 1]  # timesteps 999, 961, 909 | 833, 714, 500


def test_rows_batch_as_if_alone(i2v: WanDenoiseAdapter) -> None:
    """One step call over states at different steps (so on different transformers) and with
    texts of different lengths gives each state what it gets alone."""
    condition = torch.randn(1, 16, 3, HEIGHT // 8, WIDTH // 8)
    payloads = [
        _video(_embeddings(seed), num_inference_steps=6, seed=seed,
               condition_latents=(condition,), guidance_scale=guidance)
        for seed, guidance in ((1, 4.0), (2, 1.0))
    ] + [_video(_embeddings(3, tokens=64), num_inference_steps=6, seed=3,
                condition_latents=(condition,))]
    states = [i2v.prepare(EngineRequest(str(i), p)) for i, p in enumerate(payloads)]
    for _ in range(3):  # the first state runs ahead, onto transformer_2
        i2v.step(states[:1])
    while not all(state.step_index == 6 for state in states):
        i2v.step([state for state in states if state.step_index < 6])
    for state, payload in zip(states, payloads, strict=True):
        alone = _run(i2v, payload).latents
        assert (i2v.finish(state).latents - alone).abs().max().item() <= TOLERANCE


# -- abort -----------------------------------------------------------------------------------


async def _terminal(
    engine: servicer.VideoEngine, payload: VideoDenoiseInput
) -> Event[NoStream, DenoisedLatents]:
    stream = engine.submit(
        EngineRequest("video", payload, StepBudget(payload.num_inference_steps))
    )
    engine.start()
    events = []
    try:
        async for event in stream:
            events.append(event)
    finally:
        await asyncio.to_thread(engine.shutdown, True, 10)
    return events[-1]


async def test_an_abort_stops_the_video_at_the_next_step(i2v: WanDenoiseAdapter) -> None:
    """An abort that arrives during step 4 (the first on transformer_2) ends the request
    there: step 4 never completes and no later step starts."""
    engine = StepEngine(i2v, max_running=2, metrics=EngineMetrics("dit", Registry()))
    forwards: list[int] = []

    def abort_on_the_low_noise_expert(module: torch.nn.Module, args: tuple[object, ...]) -> None:
        forwards.append(1)
        engine.abort("video")

    # once per forward of each transformer (see test_the_boundary_picks_the_transformer)
    i2v.transformers[0].patch_embedding.register_forward_pre_hook(lambda m, a: forwards.append(0))
    i2v.transformers[1].patch_embedding.register_forward_pre_hook(abort_on_the_low_noise_expert)
    condition = torch.zeros(1, 16, 3, HEIGHT // 8, WIDTH // 8)
    payload = _video(_embeddings(), num_inference_steps=6, guidance_scale=1.0,
                     condition_latents=(condition,))
    event = await _terminal(engine, payload)
    assert isinstance(event, Aborted), event
    assert event.step_index == 3
    assert forwards == [0, 0, 0, 1]  # the interrupted forward was the last


async def test_an_unaborted_video_completes_in_the_engine(t2v: WanDenoiseAdapter) -> None:
    engine = StepEngine(t2v, max_running=2, metrics=EngineMetrics("dit", Registry()))
    payload = _video(_embeddings())
    event = await _terminal(engine, payload)
    assert isinstance(event, Completed), event
    assert (event.result.latents - _run(t2v, payload).latents).abs().max().item() <= TOLERANCE


# -- validation ------------------------------------------------------------------------------


def _refused(adapter: WanDenoiseAdapter, payload: VideoDenoiseInput) -> str:
    with pytest.raises(InvalidInputError) as refused:
        adapter.check_inputs(payload)
    return refused.value.field_name


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        ({"num_frames": 8}, "num_frames"),  # not 4k+1
        ({"num_frames": 0}, "num_frames"),
        ({"num_frames": 85}, "num_frames"),  # over max_frames (81)
        ({"height": 40}, "size"),  # not a multiple of 8 x 2
        ({"width": 0}, "size"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
        ({"guidance_scale": float("nan")}, "guidance_scale"),
        ({"seed": -1}, "seed"),
        ({"guidance_scale_2": 2.0}, "guidance_scale_2"),  # one transformer only
        ({"boundary_ratio": 0.5}, "boundary_ratio"),
        ({"flow_shift": 0.0}, "flow_shift"),
        ({"flow_shift": 101.0}, "flow_shift"),
        ({"condition_latents": (torch.zeros(1, 16, 3, 4, 6),)}, "condition_latents"),
    ],
)
def test_text_to_video_refuses(
    t2v: WanDenoiseAdapter, fields: dict[str, Any], field_name: str
) -> None:
    assert _refused(t2v, _video(_embeddings(), **fields)) == field_name


def test_embeddings_are_checked(t2v: WanDenoiseAdapter) -> None:
    emb = _embeddings()
    no_negative = replace(emb, negative_prompt_embeds=None)
    assert _refused(t2v, _video(no_negative)) == "negative_prompt_embeds"  # guidance 5 needs it
    t2v.check_inputs(_video(no_negative, guidance_scale=1.0))  # unguided: fine
    hiding = torch.ones(1, PROMPT_MAX_TOKENS, dtype=torch.long)
    hiding[0, 7:] = 0
    assert _refused(t2v, _video(replace(emb, prompt_embeds_mask=hiding))) == "embeddings"
    too_long = torch.zeros(1, PROMPT_MAX_TOKENS + 1, 32)
    assert _refused(t2v, _video(replace(emb, prompt_embeds=too_long))) == "embeddings"


def test_video_pixels_are_bounded(t2v_dir: Path) -> None:
    """frames x height x width is bounded by the max_video_pixels option (published)."""
    adapter = WanDenoiseAdapter(t2v_dir, max_video_pixels=FRAMES * HEIGHT * WIDTH)
    assert adapter.limits.max_video_pixels == FRAMES * HEIGHT * WIDTH
    adapter.check_inputs(_video(_embeddings()))
    assert _refused(adapter, _video(_embeddings(), num_frames=FRAMES + 4)) == "num_frames"


@pytest.fixture(scope="module")
def t2v_clip_tokens_dir(t2v_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """t2v whose transformer takes 3 latent frames per token (tiny-shapes-video's layout)."""
    out = tmp_path_factory.mktemp("wan") / "t2v-patch3"
    shutil.copytree(t2v_dir, out)
    shutil.rmtree(out / "transformer")
    preset = wan.PRESETS["t2v"]
    seeded(0, 3, lambda: wan._build_transformer(preset, 16, 3)).save_pretrained(
        out / "transformer"
    )
    return out


def test_frames_come_in_whole_temporal_patches(t2v_clip_tokens_dir: Path) -> None:
    """With 3 latent frames per token only 9, 21, 33 ... frames make whole tokens: 5 frames (2
    latent frames) are refused naming the valid counts (the stock pipeline fails on them), the
    published max_frames is one of them, and 9 frames give the stock pipeline's latents."""
    adapter = WanDenoiseAdapter(t2v_clip_tokens_dir, max_frames=85)
    assert adapter.limits.max_frames == 81  # 21 latent frames; 85 would be 22
    assert adapter.limits.frame_patch == 3  # Describe's frame_patch: what the gateway rounds to
    for frames in (5, 13, 85):
        with pytest.raises(InvalidInputError) as refused:
            adapter.check_inputs(_video(_embeddings(), num_frames=frames))
        assert refused.value.field_name == "num_frames"
    with pytest.raises(InvalidInputError, match=r"one of 9, 21, 33, 45, \.\.\. 81"):
        adapter.check_inputs(_video(_embeddings(), num_frames=5))
    emb = _embeddings()
    want = WanPipeline.from_pretrained(t2v_clip_tokens_dir)(
        prompt_embeds=emb.prompt_embeds, negative_prompt_embeds=emb.negative_prompt_embeds,
        height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=2,
        guidance_scale=5.0, generator=torch.Generator("cpu").manual_seed(7),
        output_type="latent",
    ).frames
    got = _run(adapter, _video(emb, num_inference_steps=2))
    assert got.latents.shape == want.shape == (1, 16, 3, 4, 6)
    assert (got.latents - want).abs().max().item() <= TOLERANCE


def test_flow_shift_is_refused_by_a_scheduler_without_one(t2v: WanDenoiseAdapter) -> None:
    t2v.limits = replace(t2v.limits, accepts_flow_shift=False)
    assert _refused(t2v, _video(_embeddings(), flow_shift=5.0)) == "flow_shift"


def test_image_to_video_needs_one_matching_condition(i2v: WanDenoiseAdapter) -> None:
    emb = _embeddings()
    right = torch.zeros(1, 16, 3, HEIGHT // 8, WIDTH // 8)
    i2v.check_inputs(_video(emb, condition_latents=(right,), guidance_scale_2=2.0,
                            boundary_ratio=0.5))
    for conditions in [(), (right, right), (torch.zeros(1, 16, 2, 4, 6),),
                       (torch.full_like(right, float("inf")),)]:
        assert _refused(i2v, _video(emb, condition_latents=conditions)) == "condition_latents"
    assert _refused(i2v, _video(emb, condition_latents=(right,), boundary_ratio=1.5)) == (
        "boundary_ratio"
    )


# -- the servicer ----------------------------------------------------------------------------


def test_the_servicer_serves_wan_folders(i2v_dir: Path, t2v_dir: Path) -> None:
    """build_stage picks the Wan adapter by model_index.json, Describe publishes its facts."""
    assert servicer.pipeline_class(i2v_dir) == "WanImageToVideoPipeline"
    i2v = WanDenoiseAdapter(i2v_dir)
    engine = StepEngine(i2v)
    described = servicer._describe(i2v_dir, engine, i2v.limits, ExecutionMode.STEP,
                                   i2v.placement)
    assert (described.task, described.max_frames, described.frame_multiple) == (
        "image-to-video", 81, 4)
    assert described.frame_patch == 1
    assert described.max_condition_images == 1
    assert described.has_second_transformer and described.accepts_flow_shift
    assert described.size_multiple == 16
    assert described.max_video_pixels == i2v.limits.max_video_pixels > 0
    t2v_facts = WanDenoiseAdapter(t2v_dir).limits
    assert (t2v_facts.task, t2v_facts.max_condition_images) == ("text-to-video", 0)
    assert not t2v_facts.has_second_transformer


def test_previews_show_the_middle_frame_every_k_steps(t2v_dir: Path) -> None:
    """The tiny Wan VAE is small: the DiT may decode the middle latent frame's x0 itself."""
    t2v = WanDenoiseAdapter(t2v_dir, preview_painter=PainterChoice.DECODER)
    assert t2v.painter is not None and t2v.painter.name == "decoder"
    payload = _video(_embeddings(), preview=PreviewOptions(every=2, size=24))
    t2v.check_inputs(payload)
    state = t2v.prepare(EngineRequest("p", payload))
    assert state.preview is not None
    frames = torch.arange(3.0).view(1, 1, 3, 1, 1).expand(1, 16, 3, 4, 6)  # value = frame
    middle = state.preview.grid(frames)
    assert middle.shape == (16, 4, 6) and bool((middle == 1.0).all())  # frame 1 of 0, 1, 2
    partials = [t2v.step([state])[0].partial for _ in range(4)]
    t2v.release(state)
    assert [p.step_index if p else None for p in partials] == [None, 2, None, 4]
    last = partials[3]
    assert last is not None and last.pixels.shape == (16, 24, 3)  # 32 x 48 -> 24 long side
    refused = _video(_embeddings(), preview=PreviewOptions(every=1, size=10_000))
    with pytest.raises(InvalidInputError) as error:
        t2v.check_inputs(refused)
    assert error.value.field_name == "preview"


def _start(**fields: object) -> pb.DenoiseRequest:
    emb = _embeddings()
    start = pb.DenoiseStart(
        request_id="r", prompt_embeds=to_proto(emb.prompt_embeds), height=HEIGHT, width=WIDTH,
        negative_prompt_embeds=optional_to_proto(emb.negative_prompt_embeds),
        num_inference_steps=4, true_cfg_scale=5.0, seed=7, **fields,  # type: ignore[arg-type]
    )
    return pb.DenoiseRequest(start=start)


def test_the_wire_maps_the_video_fields() -> None:
    condition = torch.zeros(1, 16, 3, 4, 6)
    request = servicer.VIDEO_WIRE.make_request(
        _start(num_frames=FRAMES, guidance_scale_2=0.0, flow_shift=5.0,
               condition_latents=[to_proto(condition)]), None)
    payload = request.payload
    assert (payload.num_frames, payload.guidance_scale, payload.seed) == (FRAMES, 5.0, 7)
    assert payload.guidance_scale_2 == 0.0  # set, even to 0, is not unset
    assert (payload.boundary_ratio, payload.flow_shift) == (None, 5.0)
    assert len(payload.condition_latents) == 1
    assert request.budget.total_steps == 4


@pytest.mark.parametrize(
    ("wire", "fields", "field_name"),
    [
        (servicer.VIDEO_WIRE, {"sigmas": [1.0, 0.5]}, "sigmas"),
        (servicer.WIRE, {"num_frames": 9}, "num_frames"),
        (servicer.WIRE, {"boundary_ratio": 0.5}, "boundary_ratio"),
        (servicer.WIRE, {"flow_shift": 3.0}, "flow_shift"),
    ],
)
def test_the_wire_refuses_fields_the_model_does_not_take(
    wire: servicer.DenoiseWire[object], fields: dict[str, object], field_name: str
) -> None:
    with pytest.raises(InvalidInputError) as refused:
        wire.make_request(_start(**fields), None)
    assert refused.value.field_name == field_name


async def test_a_served_wan_dit_denoises_and_refuses_over_grpc(i2v_dir: Path) -> None:
    """The stage as served: options reach Describe, a stream returns the adapter's latents with
    num_frames, and a refusal is INVALID_ARGUMENT naming the field."""
    bundle = build_stage("dit", i2v_dir, {"max_frames": 43, "max_batch": 2})
    server = await start_stage(bundle)
    condition = to_proto(torch.zeros(1, 16, 3, HEIGHT // 8, WIDTH // 8))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = dit_service_pb2_grpc.DitServiceStub(channel)
            described = await stub.DescribeDit(pb.DescribeDitRequest())
            good = _start(num_frames=FRAMES, condition_latents=[condition])
            responses = [response async for response in stub.Denoise(iter([good]))]
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                async for _ in stub.Denoise(iter([_start(num_frames=8)])):
                    pass
    finally:
        await stop_stage(bundle, server, grace=0.5)
    assert (described.task, described.max_frames, described.frame_multiple) == (
        "image-to-video", 41, 4)  # 43 rounds down to 4k+1
    result = responses[-1].result
    assert (result.num_frames, result.height, result.width) == (FRAMES, HEIGHT, WIDTH)
    assert list(result.latents.shape) == [1, 16, 3, HEIGHT // 8, WIDTH // 8]
    error = parse_rpc_error(refused.value)
    assert (error.code, error.field_name) == (grpc.StatusCode.INVALID_ARGUMENT, "num_frames")
