"""The VAE stage's EncodeImage and video DecodeLatents against the stock diffusers pipelines.

Encode must give the conditioning latents QwenImageEditPipeline and WanImageToVideoPipeline
compute (one-shot `vae.encode`), though the stage runs the encoder chunk by chunk; a video decoded
chunk by chunk must give the frames of the pipelines' one-shot `vae.decode`; a cancel stops the
decode between chunks; bad input is refused naming its field.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import grpc
import numpy as np
import numpy.typing as npt
import pytest
import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline
from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline
from PIL import Image
from prometheus_client import CollectorRegistry

from stagemesh.models.families.qwen_image import latent_factor
from stagemesh.models.families.wan import WanGeometry
from stagemesh.models.qwen_image_edit import ensure_edit_model
from stagemesh.models.wan import ensure_wan_model
from stagemesh.services.vae.encode import EncodeInput, ImageEncoderAdapter
from stagemesh.services.vae.kinds import QwenEditEncoding, WanI2VEncoding, load_wan_vae
from stagemesh.services.vae.qwen_image_adapter import LatentDecoderAdapter
from stagemesh.services.vae.servicer import build_stage
from stagemesh.services.vae.video import (
    DEFAULT_DECODE_CHUNK_FRAMES,
    DEFAULT_MAX_FRAMES,
    FRAMES_EVENT_BYTES,
    MAX_VIDEO_SIDE,
    DecodedFrames,
    VideoDecoderAdapter,
    VideoLatentsInput,
)
from stagemesh.shared.devices import CPU_FLOAT32
from stagemesh.shared.engine import (
    Aborted,
    Completed,
    EngineMetrics,
    EngineRequest,
    InvalidInputError,
    Partial,
    Progress,
    StageAdapter,
    StepEngine,
)
from stagemesh.shared.engine.adapter import InputT, PartialT, ResultT, StateT, StreamT
from stagemesh.shared.engine.events import Event
from stagemesh.shared.errors import parse_rpc_error
from stagemesh.shared.proto.v1 import vae_service_pb2 as pb
from stagemesh.shared.proto.v1 import vae_service_pb2_grpc
from stagemesh.shared.stage_runtime import start_stage, stop_stage
from stagemesh.shared.torch_tensors import from_proto, to_proto

pytestmark = pytest.mark.timeout(180)

#: The stage's latents may differ from the pipelines' by float rounding only.
TOLERANCE = 1e-5
#: Wan's latent channels and the mask channels WanImageToVideoPipeline puts before them.
Z_DIM = 16


@pytest.fixture(scope="module")
def wan_dir() -> Path:
    return ensure_wan_model("i2v")


@pytest.fixture(scope="module")
def edit_dir() -> Path:
    return ensure_edit_model()


@pytest.fixture(scope="module")
def geometry(wan_dir: Path) -> WanGeometry:
    return WanGeometry.from_folder(wan_dir)


@pytest.fixture(scope="module")
def wan_vae(wan_dir: Path) -> AutoencoderKLWan:
    return load_wan_vae(wan_dir, CPU_FLOAT32)


@pytest.fixture(scope="module")
def wan_pipe(wan_dir: Path) -> WanImageToVideoPipeline:
    """The stock pipeline with only what encode and decode use (its own VAE, from the folder)."""
    pipe: WanImageToVideoPipeline = WanImageToVideoPipeline.from_pretrained(
        wan_dir, text_encoder=None, tokenizer=None, transformer=None, transformer_2=None,
        local_files_only=True)
    return pipe


def _image(height: int, width: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _video_decoder(wan_vae: AutoencoderKLWan, geometry: WanGeometry, *,
                   decode_chunk_frames: int = DEFAULT_DECODE_CHUNK_FRAMES,
                   max_frames: int = DEFAULT_MAX_FRAMES) -> VideoDecoderAdapter:
    return VideoDecoderAdapter(wan_vae, geometry, decode_chunk_frames=decode_chunk_frames,
                               max_frames=max_frames)


def _wan_encoder(wan_vae: AutoencoderKLWan, geometry: WanGeometry) -> ImageEncoderAdapter:
    limits = _video_decoder(wan_vae, geometry).limits
    return ImageEncoderAdapter(wan_vae, WanI2VEncoding.of(geometry), limits, CPU_FLOAT32)


@contextlib.asynccontextmanager
async def _running(
    adapter: StageAdapter[InputT, StreamT, StateT, PartialT, ResultT],
) -> AsyncIterator[StepEngine[InputT, StreamT, StateT, PartialT, ResultT]]:
    engine = StepEngine(adapter, metrics=EngineMetrics(adapter.stage, CollectorRegistry()))
    engine.start()
    try:
        yield engine
    finally:
        await asyncio.to_thread(engine.shutdown, True, 10)


async def _events(engine: StepEngine[InputT, StreamT, StateT, PartialT, ResultT],
                  request: EngineRequest[InputT]) -> list[Event[PartialT, ResultT]]:
    return [event async for event in engine.submit(request)]


# -- encode ---------------------------------------------------------------------------------


def test_qwen_edit_encode_equals_the_pipelines_image_latents(edit_dir: Path) -> None:
    decoder = LatentDecoderAdapter(edit_dir)
    encoding = QwenEditEncoding.of(decoder.vae, decoder.latent_factor)
    encoder = ImageEncoderAdapter(decoder.vae, encoding, decoder.limits, CPU_FLOAT32)
    image, height, width = _image(37, 50), 64, 96  # resized up, to another aspect
    payload = EncodeInput(torch.from_numpy(image), height, width)
    encoder.check_inputs(payload)
    state = encoder.prepare(EngineRequest("edit", payload))
    assert encoder.step([state])[0].finished  # one image: one chunk
    got = encoder.finish(state)

    pipe: QwenImageEditPipeline = QwenImageEditPipeline.from_pretrained(
        edit_dir, text_encoder=None, tokenizer=None, processor=None, transformer=None,
        local_files_only=True)
    # QwenImageEditPipeline.__call__ step 3, then prepare_latents' _encode_vae_image.
    resized = pipe.image_processor.resize(Image.fromarray(image), height, width)
    pixels = pipe.image_processor.preprocess(resized, height, width).unsqueeze(2)
    with torch.inference_mode():
        # The pipeline passes generator=None itself; diffusers' annotation omits None.
        want = pipe._encode_vae_image(pixels, generator=None)  # type: ignore[arg-type]
    factor = decoder.latent_factor // 2
    assert got.shape == want.shape == (1, Z_DIM, 1, height // factor, width // factor)
    assert float((got - want).abs().max()) <= TOLERANCE


async def test_wan_i2v_encode_equals_prepare_latents_one_chunk_per_step(
    wan_vae: AutoencoderKLWan, geometry: WanGeometry, wan_pipe: WanImageToVideoPipeline
) -> None:
    encoder = _wan_encoder(wan_vae, geometry)
    image, num_frames, height, width = _image(30, 41, seed=1), 9, 32, 48
    payload = EncodeInput(torch.from_numpy(image), height, width, num_frames)
    async with _running(encoder) as engine:
        events = await _events(engine, EngineRequest("i2v", payload, encoder.budget(payload)))
    assert [e.step_index for e in events if isinstance(e, Progress)] == [1, 2, 3]  # 1 + 4 + 4
    assert isinstance(events[-1], Completed)
    got = events[-1].result
    assert isinstance(got, torch.Tensor)

    pixels = wan_pipe.video_processor.preprocess(Image.fromarray(image), height=height,
                                                 width=width).to(torch.float32)
    with torch.inference_mode():
        _, condition = wan_pipe.prepare_latents(
            pixels, 1, Z_DIM, height, width, num_frames, torch.float32, torch.device("cpu"))
    want = condition[:, wan_pipe.vae_scale_factor_temporal:]  # after the first-frame mask
    assert got.shape == want.shape == (1, Z_DIM, 3, height // 8, width // 8)
    assert float((got - want).abs().max()) <= TOLERANCE


# -- video decode ---------------------------------------------------------------------------


def _pipeline_frames(pipe: WanImageToVideoPipeline, latents: torch.Tensor) -> npt.NDArray[np.uint8]:
    """The tail of WanImageToVideoPipeline.__call__ (one-shot decode), as uint8 frames."""
    vae = pipe.vae
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, Z_DIM, 1, 1, 1)
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, Z_DIM, 1, 1, 1)
    with torch.inference_mode():
        video = vae.decode(latents / latents_std + latents_mean, return_dict=False)[0]
    frames = pipe.video_processor.postprocess_video(video, output_type="pil")[0]
    return np.stack([np.asarray(frame) for frame in frames])


def _latents(latent_frames: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, Z_DIM, latent_frames, height // 8, width // 8, generator=generator)


def _frames(events: Sequence[Event[object, object]]) -> list[DecodedFrames]:
    chunks = [event.payload for event in events if isinstance(event, Partial)]
    assert all(isinstance(chunk, DecodedFrames) for chunk in chunks)
    return [chunk for chunk in chunks if isinstance(chunk, DecodedFrames)]


async def test_a_video_decoded_chunk_by_chunk_equals_the_one_shot_decode(
    wan_vae: AutoencoderKLWan, geometry: WanGeometry, wan_pipe: WanImageToVideoPipeline
) -> None:
    decoder = _video_decoder(wan_vae, geometry, decode_chunk_frames=2)
    latents, height, width = _latents(5, 32, 48), 32, 48
    payload = VideoLatentsInput(latents, height, width, num_frames=17)
    async with _running(decoder) as engine:
        events = await _events(engine, EngineRequest("t2v", payload, decoder.budget(payload)))
    chunks = _frames(events)
    # Latent frames 0-1 -> 1 + 4 frames, 2-3 -> 8 frames, 4 -> 4 frames.
    assert [(c.first_frame_index, len(c.pixels)) for c in chunks] == [(0, 5), (5, 8), (13, 4)]
    assert isinstance(events[-1], Completed)
    assert events[-1].result.num_frames == 17
    got = np.concatenate([chunk.pixels for chunk in chunks])
    want = _pipeline_frames(wan_pipe, latents)
    assert got.shape == want.shape == (17, height, width, 3)
    assert int(np.abs(got.astype(np.int16) - want.astype(np.int16)).max()) <= 1


async def test_a_cancel_stops_the_decode_between_latent_frames(
    wan_vae: AutoencoderKLWan, geometry: WanGeometry
) -> None:
    """Cancelled while the second chunk decodes its first latent frame: that chunk stops before
    its second frame, and no later chunk runs."""
    decoder = _video_decoder(wan_vae, geometry, decode_chunk_frames=2)
    payload = VideoLatentsInput(_latents(6, 32, 32), 32, 32, num_frames=21)
    forwards = 0
    reached, resume = threading.Event(), threading.Event()

    def count_forward(*_: object) -> None:  # runs on the engine's compute thread
        nonlocal forwards
        forwards += 1
        if forwards == 3:  # the first latent frame of the second chunk
            reached.set()
            resume.wait(10)

    hook = wan_vae.decoder.register_forward_pre_hook(count_forward)
    try:
        async with _running(decoder) as engine:
            stream = engine.submit(EngineRequest("cancel-me", payload, decoder.budget(payload)))
            assert await asyncio.to_thread(reached.wait, 10)
            engine.abort("cancel-me")
            resume.set()
            events = [event async for event in stream]
    finally:
        hook.remove()
    assert isinstance(events[-1], Aborted)
    assert [c.first_frame_index for c in _frames(events)] == [0]  # only the first chunk came
    assert forwards == 3  # of 6 latent frames: the first chunk's two, one of the second's


# -- limits ---------------------------------------------------------------------------------


def test_bad_input_is_refused_naming_its_field(
    wan_vae: AutoencoderKLWan, geometry: WanGeometry, edit_dir: Path
) -> None:
    decoder = _video_decoder(wan_vae, geometry, max_frames=9)
    encoder = _wan_encoder(wan_vae, geometry)
    image = torch.from_numpy(_image(8, 8))
    decoded = LatentDecoderAdapter(edit_dir)
    image_encoder = ImageEncoderAdapter(
        decoded.vae, QwenEditEncoding.of(decoded.vae, decoded.latent_factor), decoded.limits,
        CPU_FLOAT32)
    videos = [
        (VideoLatentsInput(_latents(2, 32, 32), 32, 32, 6), "num_frames"),  # not 4k+1
        (VideoLatentsInput(_latents(4, 32, 32), 32, 32, 13), "num_frames"),  # above 9
        (VideoLatentsInput(_latents(2, 32, 32), 32, 32, 0), "num_frames"),  # an image
        (VideoLatentsInput(_latents(2, 32, 32), 32, 32, 9), "latents"),  # 3 latent frames
        (VideoLatentsInput(_latents(1, 32, 32), 36, 32, 1), "size"),
    ]
    images = [
        (encoder, EncodeInput(image.float(), 32, 32), "image"),
        (encoder, EncodeInput(image[:0], 32, 32), "image"),
        (encoder, EncodeInput(image, 32, 2 * MAX_VIDEO_SIDE), "size"),
        (encoder, EncodeInput(image, 32, 32, num_frames=6), "num_frames"),
        (image_encoder, EncodeInput(image, 32, 32, num_frames=5), "num_frames"),  # images only
    ]
    checks: list[tuple[Callable[[], None], str]] = [
        *((functools.partial(decoder.check_inputs, video), field) for video, field in videos),
        *((functools.partial(adapter.check_inputs, payload), field)
          for adapter, payload, field in images),
    ]
    for check, field in checks:
        with pytest.raises(InvalidInputError) as refused:
            check()
        assert refused.value.field_name == field, (check, refused.value)
    with pytest.raises(ValueError, match="decode_chunk_frames"):
        _video_decoder(wan_vae, geometry, decode_chunk_frames=0)


def test_each_frames_event_fits_in_one_stage_message(
    wan_vae: AutoencoderKLWan, geometry: WanGeometry
) -> None:
    decoder = _video_decoder(wan_vae, geometry, decode_chunk_frames=4)
    assert decoder.per_step(64, 64) == 4
    big = decoder.per_step(MAX_VIDEO_SIDE, MAX_VIDEO_SIDE)
    assert big == 1  # 4 video frames of 2048x2048 already take 48 MiB
    assert big * geometry.temporal_factor * MAX_VIDEO_SIDE**2 * 3 <= FRAMES_EVENT_BYTES


# -- the stage over gRPC --------------------------------------------------------------------


async def test_the_stage_serves_both_rpcs_and_publishes_its_limits(
    wan_dir: Path, edit_dir: Path
) -> None:
    wan = build_stage(wan_dir, {"max_frames": 9, "decode_chunk_frames": 1})
    qwen = build_stage(edit_dir, {})
    servers = [await start_stage(wan), await start_stage(qwen)]
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{servers[0].port}") as channel:
            stub = vae_service_pb2_grpc.VaeServiceStub(channel)
            facts = await stub.DescribeVae(pb.DescribeVaeRequest())
            assert (facts.can_encode, facts.max_frames, facts.size_multiple) == (True, 9, 8)
            kinds = [r.WhichOneof("event") async for r in stub.DecodeLatents(iter([
                pb.DecodeLatentsRequest(start=pb.DecodeLatentsStart(
                    request_id="v", latents=to_proto(_latents(2, 16, 16)), height=16, width=16,
                    num_frames=5))]))]
            assert kinds == ["queued", "frames", "frames", "result"]
            encoded = [r async for r in stub.EncodeImage(iter([pb.EncodeImageRequest(
                start=pb.EncodeImageStart(request_id="e", image=to_proto(
                    torch.from_numpy(_image(20, 24))), height=16, width=16, num_frames=5))]))]
            assert [r.WhichOneof("event") for r in encoded] == [
                "queued", "progress", "progress", "result"]
            assert list(from_proto(encoded[-1].result.latents).shape) == [1, Z_DIM, 2, 2, 2]
            await _assert_refused(stub, num_frames=13, field="num_frames")  # above max_frames
        async with grpc.aio.insecure_channel(f"127.0.0.1:{servers[1].port}") as channel:
            stub = vae_service_pb2_grpc.VaeServiceStub(channel)
            facts = await stub.DescribeVae(pb.DescribeVaeRequest())
            assert (facts.can_encode, facts.max_frames) == (True, 0)
            assert facts.size_multiple == latent_factor(edit_dir)
            await _assert_refused(stub, num_frames=5, field="num_frames")  # images only
    finally:
        await stop_stage(wan, servers[0], grace=0.5)
        await stop_stage(qwen, servers[1], grace=0.5)


async def _assert_refused(stub: vae_service_pb2_grpc.VaeServiceAsyncStub, *, num_frames: int,
                          field: str) -> None:
    start = pb.DecodeLatentsStart(request_id="bad", latents=to_proto(_latents(4, 16, 16)),
                                  height=16, width=16, num_frames=num_frames)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        async for _ in stub.DecodeLatents(iter([pb.DecodeLatentsRequest(start=start)])):
            pass
    error = parse_rpc_error(failure.value)
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.field_name == field
