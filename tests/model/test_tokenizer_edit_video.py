"""The Tokenizer stage for image edit (Qwen-Image-Edit) and video (Wan): what the stock pipelines
encode, and what the stage refuses.

The reference is each stock pipeline's own `__call__`, stopped right after its `encode_prompt`
calls, so the input image is resized (and the Wan negative prompt defaulted) by the pipeline
itself, not by a copy of its rules.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import numpy as np
import PIL.Image
import pytest
import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline
from diffusers.pipelines.wan.pipeline_wan import WanPipeline
from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline

from stagemesh.models.families.qwen_image import PromptEmbeddings
from stagemesh.models.families.qwen_vl_processor import install_processor_support
from stagemesh.models.qwen_image import ensure_model
from stagemesh.models.qwen_image_edit import ensure_edit_model
from stagemesh.models.wan import ensure_wan_model
from stagemesh.services.tokenizer.base import (
    DEFAULT_MAX_PROMPT_CHARS,
    MAX_IMAGE_PIXELS,
    PromptAdapterBase,
    PromptInput,
    PromptState,
    RgbArray,
)
from stagemesh.services.tokenizer.families import Family, build_adapter, family_of
from stagemesh.services.tokenizer.qwen_image_edit_adapter import EditPromptAdapter
from stagemesh.services.tokenizer.servicer import build_stage, max_request_bytes, stage_bundle
from stagemesh.services.tokenizer.wan_adapter import WanPromptAdapter
from stagemesh.shared.devices import CPU_FLOAT32
from stagemesh.shared.engine.adapter import EngineRequest, InvalidInputError
from stagemesh.shared.errors import parse_rpc_error
from stagemesh.shared.limits import MAX_STAGE_MESSAGE_BYTES
from stagemesh.shared.proto.v1 import tokenizer_service_pb2 as pb
from stagemesh.shared.proto.v1 import tokenizer_service_pb2_grpc
from stagemesh.shared.stage_runtime import start_stage, stop_stage
from stagemesh.shared.tensors import array_to_proto
from stagemesh.shared.torch_tensors import from_proto

if TYPE_CHECKING:  # the async stub exists in the type stubs only
    from stagemesh.shared.proto.v1.tokenizer_service_pb2_grpc import (
        TokenizerServiceAsyncStub as Stub,
    )

TOLERANCE = 1e-5
CPU = torch.device("cpu")
EDIT_PROMPT = "make the circle blue"
#: The edit stage's pixel limit in these tests (the default is MAX_IMAGE_PIXELS).
EDIT_PIXELS = 64 * 96
VIDEO_PROMPT = "a red ball   rolls to the left"  # cleaned by the pipeline (spaces)
VIDEO_NEGATIVE = "blurry, static, low quality"
WAN_LENGTH = 512  # WanPipeline.__call__'s max_sequence_length


def _image(height: int, width: int, seed: int = 0) -> RgbArray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def edit_dir() -> Path:
    return ensure_edit_model()


@pytest.fixture(scope="module")
def edit_encoder(edit_dir: Path) -> EditPromptAdapter:
    return EditPromptAdapter(edit_dir, max_image_pixels=EDIT_PIXELS)


@pytest.fixture(scope="module")
def wan_dir() -> Path:
    return ensure_wan_model("t2v")


@pytest.fixture(scope="module")
def wan_encoder(wan_dir: Path) -> WanPromptAdapter:
    return WanPromptAdapter(wan_dir)


def _run(encoder: PromptAdapterBase, inputs: Sequence[PromptInput]) -> list[PromptEmbeddings]:
    """The engine's path: check_inputs, prepare, one step for all, finish."""
    states: list[PromptState] = []
    for index, payload in enumerate(inputs):
        encoder.check_inputs(payload)
        states.append(encoder.prepare(EngineRequest(request_id=f"r{index}", payload=payload)))
    outputs = encoder.step(states)
    assert [(o.finished, o.error) for o in outputs] == [(True, None)] * len(states)
    return [encoder.finish(state) for state in states]


class _Encoded(Exception):
    """Stops a stock pipeline's __call__ once it has encoded its prompts."""


def _stock_encodings(
    pipe: QwenImageEditPipeline | WanPipeline, calls: int, **call_kwargs: object
) -> list[object]:
    """What the stock pipeline's `__call__` gets from its first `calls` encode_prompt calls."""
    original: Callable[..., object] = pipe.encode_prompt
    recorded: list[object] = []

    def record(*args: object, **kwargs: object) -> object:
        recorded.append(original(*args, **kwargs))
        if len(recorded) == calls:
            raise _Encoded
        return recorded[-1]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipe, "encode_prompt", record)
        with pytest.raises(_Encoded), torch.inference_mode():
            pipe(**call_kwargs)
    return recorded


def _assert_close(actual: torch.Tensor | None, expected: object) -> None:
    assert isinstance(actual, torch.Tensor) and isinstance(expected, torch.Tensor)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert (actual - expected).abs().max().item() <= TOLERANCE


def _field_of(encoder: PromptAdapterBase, payload: PromptInput) -> str:
    """The field a request is refused for, by check_inputs or (tokens) by prepare."""
    with pytest.raises(InvalidInputError) as refusal:
        encoder.check_inputs(payload)
        encoder.prepare(EngineRequest(request_id="bad", payload=payload))
    return refusal.value.field_name


# -- image edit --------------------------------------------------------------------------------


def test_edit_embeddings_are_the_stock_pipelines(
    edit_dir: Path, edit_encoder: EditPromptAdapter
) -> None:
    image = _image(48, 80)  # not square: the pipeline's ~1 MP resize keeps the ratio
    (result,) = _run(edit_encoder, [PromptInput(EDIT_PROMPT, " ", images=(image,))])
    install_processor_support()
    pipe = QwenImageEditPipeline.from_pretrained(edit_dir, local_files_only=True)
    positive, negative = _stock_encodings(
        pipe, 2, image=PIL.Image.fromarray(image), prompt=EDIT_PROMPT, negative_prompt=" ",
        true_cfg_scale=4.0, num_inference_steps=1)
    assert isinstance(positive, tuple) and isinstance(negative, tuple)
    _assert_close(result.prompt_embeds, positive[0])
    _assert_close(result.negative_prompt_embeds, negative[0])
    # One text alone: every token is valid, and the pipeline drops the mask.
    assert positive[1] is None and negative[1] is None
    assert result.prompt_embeds_mask is None and result.negative_prompt_embeds_mask is None
    # The image's vision tokens are part of the embeddings: more than the text alone.
    assert result.prompt_embeds.shape[1] > edit_encoder.prompt_token_count(EDIT_PROMPT)


def test_edit_requests_sharing_a_step_encode_as_alone(edit_encoder: EditPromptAdapter) -> None:
    first = PromptInput(EDIT_PROMPT, images=(_image(40, 40, seed=1),))
    second = PromptInput("turn the square into a triangle", "", images=(_image(60, 30, seed=2),))
    together = _run(edit_encoder, [first, second])
    alone = [_run(edit_encoder, [payload])[0] for payload in (first, second)]
    for shared, single in zip(together, alone, strict=True):
        assert torch.equal(shared.prompt_embeds, single.prompt_embeds)
    assert together[0].negative_prompt_embeds is None
    assert alone[1].negative_prompt_embeds is not None
    assert together[1].negative_prompt_embeds is not None
    assert torch.equal(together[1].negative_prompt_embeds, alone[1].negative_prompt_embeds)


def test_edit_limits_and_refusals(edit_encoder: EditPromptAdapter) -> None:
    limits = edit_encoder.limits
    assert (limits.max_images, limits.max_image_pixels) == (1, EDIT_PIXELS)
    ok = _image(64, 96)  # exactly at the pixel limit
    edit_encoder.check_inputs(PromptInput(EDIT_PROMPT, images=(ok,)))
    refused: list[tuple[RgbArray, ...]] = [
        (),  # an edit needs its image
        (ok, ok),  # the pipeline takes one image
        (_image(65, 96),),  # over the pixel limit
        (ok.astype(np.float32),),  # not uint8
        (ok[:, :, 0],),  # not [H, W, 3]
        (np.zeros((8, 8, 4), dtype=np.uint8),),  # RGBA
        (np.zeros((0, 8, 3), dtype=np.uint8),),  # empty
    ]
    for images in refused:
        assert _field_of(edit_encoder, PromptInput(EDIT_PROMPT, images=images)) == "images"
    assert _field_of(edit_encoder, PromptInput("", images=(ok,))) == "prompt"
    long = PromptInput("a red circle " * 60, images=(ok,), max_sequence_length=64)
    assert _field_of(edit_encoder, long) == "prompt"  # too many tokens, found in prepare


def test_each_pipeline_class_has_its_family(edit_dir: Path, wan_dir: Path) -> None:
    assert family_of(ensure_model("tiny")) is Family.QWEN_IMAGE  # text-to-image
    assert family_of(edit_dir) is Family.QWEN_IMAGE_EDIT
    assert family_of(wan_dir) is Family.WAN
    assert family_of(ensure_wan_model("i2v")) is Family.WAN
    with pytest.raises(ValueError, match="WanPipeline"):  # it names what it serves
        family_of(ensure_wan_model("i2v") / "vae")  # no model_index.json there


# -- video (Wan) -------------------------------------------------------------------------------


def test_wan_embeddings_are_the_stock_pipelines(
    wan_dir: Path, wan_encoder: WanPromptAdapter
) -> None:
    """Two requests share one forward; each gets what WanPipeline.__call__ encodes for it alone
    (an empty negative prompt is what the stock pipeline encodes when none is given)."""
    inputs = [PromptInput(VIDEO_PROMPT, ""), PromptInput("a cat", VIDEO_NEGATIVE)]
    results = _run(wan_encoder, inputs)
    pipe = WanPipeline.from_pretrained(wan_dir, local_files_only=True)
    for payload, result in zip(inputs, results, strict=True):
        negative = payload.negative_prompt or None  # "" is the stock default
        (encoded,) = _stock_encodings(
            pipe, 1, prompt=payload.prompt, negative_prompt=negative, guidance_scale=5.0,
            height=64, width=64, num_frames=5, num_inference_steps=1)
        assert isinstance(encoded, tuple)
        _assert_close(result.prompt_embeds, encoded[0])
        _assert_close(result.negative_prompt_embeds, encoded[1])
        assert result.prompt_embeds.shape[1] == WAN_LENGTH
        assert result.prompt_embeds_mask is None and result.negative_prompt_embeds_mask is None
    # Trimmed to the real tokens and zero-padded back: the tail past the tokens is zeros.
    tokens = wan_encoder.prompt_token_count(VIDEO_PROMPT)
    assert results[0].prompt_embeds[0, tokens:].abs().max().item() == 0.0
    assert results[0].prompt_embeds[0, :tokens].abs().min().item() > 0.0


def test_wan_image_to_video_folder_uses_the_same_encoder() -> None:
    i2v_dir = ensure_wan_model("i2v")
    # A text-only model publishes no image limits, whatever the options say.
    encoder = build_adapter(i2v_dir, {"max_image_pixels": 1024}, CPU_FLOAT32)
    assert isinstance(encoder, WanPromptAdapter)
    assert (encoder.limits.max_images, encoder.limits.max_image_pixels) == (0, 0)
    (result,) = _run(encoder, [PromptInput(VIDEO_PROMPT, VIDEO_NEGATIVE)])
    pipe = WanImageToVideoPipeline.from_pretrained(i2v_dir, local_files_only=True)
    with torch.inference_mode():
        positive, negative = pipe.encode_prompt(
            VIDEO_PROMPT, VIDEO_NEGATIVE, max_sequence_length=WAN_LENGTH, device=CPU)
    _assert_close(result.prompt_embeds, positive)
    _assert_close(result.negative_prompt_embeds, negative)


def test_wan_lengths_and_refusals(wan_encoder: WanPromptAdapter) -> None:
    assert wan_encoder.limits.max_sequence_length == WAN_LENGTH
    assert (wan_encoder.limits.max_images, wan_encoder.limits.max_image_pixels) == (0, 0)
    short = PromptInput(VIDEO_PROMPT, max_sequence_length=16)
    (result,) = _run(wan_encoder, [short])
    with torch.inference_mode():
        expected, _ = wan_encoder._pipeline.encode_prompt(
            VIDEO_PROMPT, do_classifier_free_guidance=False, max_sequence_length=16, device=CPU)
    _assert_close(result.prompt_embeds, expected)  # padded to the length asked for
    states = [wan_encoder.prepare(EngineRequest(request_id=f"k{n}", payload=p))
              for n, p in enumerate([short, PromptInput(VIDEO_PROMPT)])]
    assert wan_encoder.batch_key(states[0]) != wan_encoder.batch_key(states[1])
    image = PromptInput(VIDEO_PROMPT, images=(_image(8, 8),))
    assert _field_of(wan_encoder, image) == "images"  # Wan reads images through the VAE only
    too_long = PromptInput("a red ball " * 20, max_sequence_length=16)
    assert _field_of(wan_encoder, too_long) == "prompt"  # the pipeline would cut it silently
    over = PromptInput(VIDEO_PROMPT, max_sequence_length=WAN_LENGTH + 1)
    assert _field_of(wan_encoder, over) == "max_sequence_length"


# -- the stage on the wire ---------------------------------------------------------------------


@pytest.fixture
async def edit_stage(edit_dir: Path, edit_encoder: EditPromptAdapter) -> AsyncIterator[Stub]:
    """The stage around the module's adapter (one load; the tests use it one at a time)."""
    bundle = stage_bundle(edit_encoder, edit_dir)
    server = await start_stage(bundle)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield tokenizer_service_pb2_grpc.TokenizerServiceStub(channel)
    await stop_stage(bundle, server, grace=0.5)


async def _encode(
    stub: Stub, start: pb.EncodePromptStart
) -> list[pb.EncodePromptResponse]:
    return [reply async for reply in stub.EncodePrompt(iter([pb.EncodePromptRequest(start=start)]))]


async def test_the_edit_stage_publishes_and_enforces_its_image_limits(
    edit_stage: Stub, edit_encoder: EditPromptAdapter
) -> None:
    described = await edit_stage.DescribeTokenizer(pb.DescribeTokenizerRequest())
    assert (described.max_images, described.max_image_pixels) == (1, EDIT_PIXELS)
    image = _image(48, 80)
    start = pb.EncodePromptStart(request_id="ok", prompt=EDIT_PROMPT,
                                 images=[array_to_proto(image)])
    replies = await _encode(edit_stage, start)
    assert replies[-1].WhichOneof("event") == "result"
    (expected,) = _run(edit_encoder, [PromptInput(EDIT_PROMPT, images=(image,))])
    assert torch.equal(from_proto(replies[-1].result.prompt_embeds), expected.prompt_embeds)
    malformed = array_to_proto(image)
    malformed.data = malformed.data[:-1]
    for bad in ([array_to_proto(image)] * 2, [malformed], [array_to_proto(_image(65, 96))],
                [array_to_proto(image.astype(np.int16))]):
        start = pb.EncodePromptStart(request_id="bad", prompt=EDIT_PROMPT, images=bad)
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await _encode(edit_stage, start)
        error = parse_rpc_error(failure.value)
        assert (error.code, error.field_name) == (grpc.StatusCode.INVALID_ARGUMENT, "images")


async def test_the_wan_stage_publishes_text_only(wan_dir: Path) -> None:
    bundle = build_stage(wan_dir, {})
    server = await start_stage(bundle)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = tokenizer_service_pb2_grpc.TokenizerServiceStub(channel)
            described = await stub.DescribeTokenizer(pb.DescribeTokenizerRequest())
            assert (described.max_images, described.max_image_pixels) == (0, 0)
            assert described.max_sequence_length == WAN_LENGTH
            start = pb.EncodePromptStart(request_id="w", prompt=VIDEO_PROMPT, negative_prompt="")
            replies = await _encode(stub, start)
            result = replies[-1].result
            assert list(result.prompt_embeds.shape)[:2] == [1, WAN_LENGTH]
            assert list(result.negative_prompt_embeds.shape)[:2] == [1, WAN_LENGTH]
            assert not result.HasField("prompt_embeds_mask")
    finally:
        await stop_stage(bundle, server, grace=0.5)


def test_the_largest_edit_request_fits_a_stage_message(edit_dir: Path) -> None:
    largest = max_request_bytes(DEFAULT_MAX_PROMPT_CHARS, 1, MAX_IMAGE_PIXELS)
    assert 3 * MAX_IMAGE_PIXELS < largest <= MAX_STAGE_MESSAGE_BYTES
    with pytest.raises(ValueError, match="max_image_pixels"):  # refused before any loading
        build_adapter(edit_dir, {"max_image_pixels": 0}, CPU_FLOAT32)
