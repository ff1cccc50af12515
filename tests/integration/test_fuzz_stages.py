"""Fuzz every stage directly, as a caller that skipped the gateway: hypothesis builds start
messages (and the codec's streamed input) for each stage RPC, mixing valid values, edge values
and garbage (unknown enum values, NaN, tensors whose shape, dtype and bytes disagree), and sends
them to the real tiny stages over gRPC.

What must hold whoever calls: a stream ends with a result, or with a status that is the
caller's fault (INVALID_ARGUMENT naming a field, RESOURCE_EXHAUSTED for a message over the
stage's size limit), never INTERNAL or UNKNOWN. The stages run with tight limits so a valid
request costs milliseconds; examples are bounded so the suite takes well under 60 s.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf.message import Message
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from stagemesh.models.speech import ensure_speech_model
from stagemesh.shared.errors import parse_rpc_error
from stagemesh.shared.limits import MAX_REQUEST_ID_CHARS, MAX_STAGE_REQUEST_ID_CHARS
from stagemesh.shared.proto.v1 import codec_service_pb2 as codec
from stagemesh.shared.proto.v1 import (
    codec_service_pb2_grpc,
    common_pb2,
    dit_service_pb2_grpc,
    talker_service_pb2_grpc,
    tokenizer_service_pb2_grpc,
    vae_service_pb2_grpc,
)
from stagemesh.shared.proto.v1 import dit_service_pb2 as dit
from stagemesh.shared.proto.v1 import talker_service_pb2 as talker
from stagemesh.shared.proto.v1 import tokenizer_service_pb2 as tokenizer
from stagemesh.shared.proto.v1 import vae_service_pb2 as vae
from stagemesh.shared.tensors import array_to_proto

pytestmark = pytest.mark.timeout(180)

#: Tight limits: a valid request is a few milliseconds of tiny-model work.
STAGE_OPTIONS: dict[str, dict[str, object]] = {
    "tokenizer": {"max_prompt_chars": 200},
    "dit": {"max_steps": 2, "max_side": 64, "max_pixels": 64 * 64},
    "vae": {},
    "talker": {"max_new_frames": 4, "max_input_chars": 40},
    "codec": {},
}
#: Examples per stage RPC.
MAX_EXAMPLES = 30
#: A stream that takes longer has hung: the test fails with DEADLINE_EXCEEDED.
CALL_TIMEOUT_S = 30.0
#: Statuses that say "your request is wrong" (the caller's fault, not the stage's).
CALLER_FAULTS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION}
FUZZ = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck))

Call = Callable[[Iterable[Any]], Iterator[Any]]


@pytest.fixture(scope="module")
def stages(tiny_model_dir: Path, make_stages_thread: Any) -> Iterator[dict[str, grpc.Channel]]:
    """A channel to each of the five tiny stages (served on a loop in their own thread)."""
    speech = ensure_speech_model()
    models = {"tokenizer": tiny_model_dir, "dit": tiny_model_dir, "vae": tiny_model_dir,
              "talker": speech, "codec": speech}
    thread = make_stages_thread({name: (model, STAGE_OPTIONS[name])
                                 for name, model in models.items()})
    thread.start()
    channels = {name: grpc.insecure_channel(address)
                for name, address in thread.addresses.items()}
    yield channels
    for channel in channels.values():
        channel.close()
    thread.stop()


class Outcomes:
    """How the streams of one test ended; `check` is the rule every stream must keep."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def run(self, call: Call, messages: list[Message]) -> None:
        """One stream to its end; fails unless it ends with a result or a caller's-fault
        status (INVALID_ARGUMENT naming a field)."""
        try:
            replies = list(call(iter(messages)))
        except grpc.RpcError as error:
            failure = parse_rpc_error(error)
            assert failure.code in CALLER_FAULTS, f"{failure} for {messages}"
            if failure.code == grpc.StatusCode.INVALID_ARGUMENT:
                assert failure.field_name, f"{failure} names no field, for {messages}"
            self.seen.add(failure.code.name)
            return
        assert replies, f"no reply and no status for {messages}"
        event = replies[-1].WhichOneof("event")
        assert event in ("result", "aborted"), (replies[-1], messages)
        self.seen.add(str(event))

    def assert_both_kinds(self) -> None:
        """The examples reached the model (a result) and its checks (a refusal)."""
        assert {"result", "INVALID_ARGUMENT"} <= self.seen, self.seen


def stream(channel_call: Any) -> Call:
    return lambda messages: channel_call(messages, timeout=CALL_TIMEOUT_S)


# -- strategies ---------------------------------------------------------------------------------

#: Text protobuf can carry (valid UTF-8: no lone surrogates), control characters included.
texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=300)
request_ids = st.one_of(st.from_regex(r"[A-Za-z0-9._:-]{1,24}", fullmatch=True),
                        st.text(st.characters(exclude_categories=["Cs"]),
                                max_size=MAX_REQUEST_ID_CHARS + 2))
small_ints = st.one_of(st.integers(-3, 80), st.integers(-(2**31), 2**31 - 1))
floats = st.floats(width=32)  # NaN and the infinities included


def mostly(valid: st.SearchStrategy[Any],
           garbage: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Valid values three times in four: whole requests then often pass every check and reach
    the model, with one odd field at a time."""
    return st.one_of(valid, valid, valid, garbage)


#: Dtype values, unknown ones included (proto3 enums are open).
dtypes = st.integers(-1, 10)


@st.composite
def tensors(draw: Callable[[st.SearchStrategy[Any]], Any],
            valid: list[common_pb2.Tensor]) -> common_pb2.Tensor:
    """A tensor from `valid` (maybe with its bytes cut), or one whose parts disagree."""
    if valid and draw(st.booleans()):
        tensor = common_pb2.Tensor()
        tensor.CopyFrom(draw(st.sampled_from(valid)))
        if draw(st.booleans()):
            tensor.data = tensor.data[:draw(st.integers(0, len(tensor.data)))]
        return tensor
    return common_pb2.Tensor(dtype=draw(dtypes),  # an int: unknown values too (open enum)
                             shape=draw(st.lists(st.integers(-2, 70_000), max_size=4)),
                             data=draw(st.binary(max_size=2048)))


def tensor_of(values: list[float], shape: list[int],
              dtype: common_pb2.Dtype.ValueType) -> common_pb2.Tensor:
    numpy_dtype = {common_pb2.DTYPE_FLOAT32: np.float32, common_pb2.DTYPE_INT64: np.int64}[dtype]
    return array_to_proto(np.asarray(values, dtype=numpy_dtype).reshape(shape))


# -- one test per stage RPC ------------------------------------------------------------------


def test_tokenizer_encode_prompt(stages: dict[str, grpc.Channel]) -> None:
    call = stream(tokenizer_service_pb2_grpc.TokenizerServiceStub(stages["tokenizer"])
                  .EncodePrompt)

    outcomes = Outcomes()

    @FUZZ
    @example(request_id="ok-1", prompt="a red circle", negative=None, length=0)
    @given(request_id=request_ids, prompt=texts, negative=st.none() | texts,
           length=small_ints)
    def check(request_id: str, prompt: str, negative: str | None, length: int) -> None:
        start = tokenizer.EncodePromptStart(request_id=request_id, prompt=prompt,
                                            negative_prompt=negative,
                                            max_sequence_length=length)
        outcomes.run(call, [tokenizer.EncodePromptRequest(start=start)])

    check()
    outcomes.assert_both_kinds()


def test_tokenizer_refuses_a_huge_prompt_before_reading_it(
    stages: dict[str, grpc.Channel]
) -> None:
    """The issue's 20 MB prompt: refused by the stage's message limit, nothing tokenized."""
    call = tokenizer_service_pb2_grpc.TokenizerServiceStub(stages["tokenizer"]).EncodePrompt
    start = tokenizer.EncodePromptStart(request_id="huge", prompt="a" * (20 * 1024 * 1024))
    with pytest.raises(grpc.RpcError) as error:
        list(call(iter([tokenizer.EncodePromptRequest(start=start)]), timeout=CALL_TIMEOUT_S))
    assert parse_rpc_error(error.value).code == grpc.StatusCode.RESOURCE_EXHAUSTED


def valid_embeddings(channel: grpc.Channel) -> common_pb2.Tensor:
    call = tokenizer_service_pb2_grpc.TokenizerServiceStub(channel).EncodePrompt
    start = tokenizer.EncodePromptStart(request_id="seed-embeds", prompt="a red circle")
    replies = list(call(iter([tokenizer.EncodePromptRequest(start=start)]),
                        timeout=CALL_TIMEOUT_S))
    embeds: common_pb2.Tensor = replies[-1].result.prompt_embeds
    return embeds


def test_dit_denoise(stages: dict[str, grpc.Channel]) -> None:
    call = stream(dit_service_pb2_grpc.DitServiceStub(stages["dit"]).Denoise)
    embeds = [valid_embeddings(stages["tokenizer"])]
    sides = mostly(st.sampled_from([16, 32, 64]), small_ints)

    outcomes = Outcomes()

    @FUZZ
    @example(request_id="ok-1", prompt=embeds[0], negative=None, height=32, width=32, steps=2,
             sigmas=[], cfg=0.0, seed=1, mode=0, priority=0)
    @given(request_id=request_ids, prompt=tensors(embeds), negative=st.none() | tensors(embeds),
           height=sides, width=sides, steps=mostly(st.integers(1, 2), small_ints),
           sigmas=mostly(st.just([]), st.lists(floats, max_size=4)),
           cfg=mostly(st.floats(0, 5), floats), seed=st.integers(-(2**63), 2**63 - 1),
           mode=mostly(st.integers(0, 1), st.integers(-1, 4)), priority=small_ints)
    def check(request_id: str, prompt: common_pb2.Tensor, negative: common_pb2.Tensor | None,
              height: int, width: int, steps: int, sigmas: list[float], cfg: float, seed: int,
              mode: int, priority: int) -> None:
        start = dit.DenoiseStart(
            request_id=request_id, prompt_embeds=prompt, negative_prompt_embeds=negative,
            height=height, width=width, num_inference_steps=steps, sigmas=sigmas,
            true_cfg_scale=cfg, seed=seed,
            execution_mode=common_pb2.ExecutionMode.ValueType(mode), priority=priority)
        outcomes.run(call, [dit.DenoiseRequest(start=start)])

    check()
    outcomes.assert_both_kinds()


def test_vae_decode_latents(stages: dict[str, grpc.Channel]) -> None:
    call = stream(vae_service_pb2_grpc.VaeServiceStub(stages["vae"]).DecodeLatents)
    # 32x32 packed latents of the tiny VAE: [1, (32/16)^2, z_dim * 4] (z_dim 16).
    latents = [tensor_of([0.1] * 4 * 64, [1, 4, 64], common_pb2.DTYPE_FLOAT32)]
    sides = st.one_of(st.sampled_from([16, 32]), small_ints)

    outcomes = Outcomes()

    @FUZZ
    @example(request_id="ok-1", tensor=latents[0], height=32, width=32)
    @given(request_id=request_ids, tensor=tensors(latents), height=sides, width=sides)
    def check(request_id: str, tensor: common_pb2.Tensor, height: int, width: int) -> None:
        start = vae.DecodeLatentsStart(request_id=request_id, latents=tensor, height=height,
                                       width=width)
        outcomes.run(call, [vae.DecodeLatentsRequest(start=start)])

    check()
    outcomes.assert_both_kinds()


def test_talker_generate_frames(stages: dict[str, grpc.Channel]) -> None:
    stub = talker_service_pb2_grpc.TalkerServiceStub(stages["talker"])
    voices = list(stub.DescribeTalker(talker.DescribeTalkerRequest(), timeout=10).voices)
    call = stream(stub.GenerateFrames)
    codes = [tensor_of([1.0] * 8, [1, 8], common_pb2.DTYPE_INT64)]

    outcomes = Outcomes()

    @FUZZ
    @example(request_id="ok-1", text="Hello.", voice="", temperature=0.9, top_p=1.0, top_k=0,
             seed=1, frames=2, reference=None, reference_text="")
    @given(request_id=request_ids, text=mostly(st.sampled_from(["Hello.", "Hi there"]), texts),
           voice=mostly(st.sampled_from(["", "default", "clone", *voices]), texts),
           temperature=mostly(st.sampled_from([0.0, 1e-40, 0.9, 2.0]), floats),
           top_p=mostly(st.floats(0, 1), floats), top_k=mostly(st.integers(0, 50), small_ints),
           seed=st.integers(-(2**63), 2**63 - 1), frames=mostly(st.integers(0, 4), small_ints),
           reference=st.none() | tensors(codes), reference_text=texts)
    def check(request_id: str, text: str, voice: str, temperature: float, top_p: float,
              top_k: int, seed: int, frames: int, reference: common_pb2.Tensor | None,
              reference_text: str) -> None:
        sampling = talker.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                         seed=seed, max_new_frames=frames)
        start = talker.GenerateFramesStart(request_id=request_id, text=text, voice=voice,
                                           sampling=sampling, reference_codes=reference,
                                           reference_text=reference_text)
        outcomes.run(call, [talker.GenerateFramesRequest(start=start)])

    check()
    outcomes.assert_both_kinds()


def test_codec_encode_audio(stages: dict[str, grpc.Channel]) -> None:
    """Voice-clone clips: odd sample rates (the issue's 8001 and 48001 Hz) and oversized clips
    are refused before any resampling or allocation."""
    call = stream(codec_service_pb2_grpc.CodecServiceStub(stages["codec"]).EncodeAudio)
    clip = [tensor_of([0.0] * 800, [800], common_pb2.DTYPE_FLOAT32)]

    outcomes = Outcomes()

    @FUZZ
    @example(request_id="ok-1", pcm=clip[0], rate=8_000)
    @given(request_id=request_ids, pcm=tensors(clip),
           rate=st.one_of(st.sampled_from([8_000, 8_001, 24_000, 44_100, 48_001]), small_ints))
    def check(request_id: str, pcm: common_pb2.Tensor, rate: int) -> None:
        start = codec.EncodeAudioStart(request_id=request_id, pcm=pcm, sample_rate=rate)
        outcomes.run(call, [codec.EncodeAudioRequest(start=start)])

    check()
    outcomes.assert_both_kinds()


def test_codec_decode_audio(stages: dict[str, grpc.Channel]) -> None:
    stub = codec_service_pb2_grpc.CodecServiceStub(stages["codec"])
    books = stub.DescribeCodec(codec.DescribeCodecRequest(), timeout=10).num_codebooks
    call = stream(stub.DecodeAudio)
    frames = [tensor_of([1.0] * books * 2, [2, books], common_pb2.DTYPE_INT64)]

    outcomes = Outcomes()

    @FUZZ
    @example(request_id="ok-1", chunk=0, initial=0, left=0, inputs=[(frames[0], False)])
    @given(request_id=request_ids, chunk=small_ints, initial=small_ints, left=small_ints,
           inputs=st.lists(st.tuples(st.none() | tensors(frames), st.booleans()), max_size=3))
    def check(request_id: str, chunk: int, initial: int, left: int,
              inputs: list[tuple[common_pb2.Tensor | None, bool]]) -> None:
        start = codec.DecodeAudioStart(request_id=request_id, chunk_frames=chunk,
                                       initial_chunk_frames=initial, left_context_frames=left)
        messages: list[Message] = [codec.DecodeAudioRequest(start=start)]
        messages += [codec.DecodeAudioRequest(input=codec.DecodeAudioInput(codes=codes,
                                                                           final=final))
                     for codes, final in inputs]
        messages.append(codec.DecodeAudioRequest(input=codec.DecodeAudioInput(final=True)))
        outcomes.run(call, messages)

    check()
    outcomes.assert_both_kinds()


# -- regressions from the issue, at the stage ------------------------------------------------


def test_a_tiny_temperature_fails_alone_not_its_batch(stages: dict[str, grpc.Channel]) -> None:
    """Speech `temperature: 1e-40` made inf/NaN logits and failed the innocent request batched
    with it; now it is refused naming `temperature`, and the other request completes."""
    stub = talker_service_pb2_grpc.TalkerServiceStub(stages["talker"])

    def generate(request_id: str, temperature: float) -> list[talker.GenerateFramesResponse]:
        sampling = talker.SamplingParams(temperature=temperature, seed=1, max_new_frames=4)
        start = talker.GenerateFramesStart(request_id=request_id, text="Hello there.",
                                           sampling=sampling)
        return list(stub.GenerateFrames(iter([talker.GenerateFramesRequest(start=start)]),
                                        timeout=CALL_TIMEOUT_S))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        innocent = pool.submit(generate, "innocent", 0.9)
        culprit = pool.submit(generate, "culprit", 1e-40)
        replies = innocent.result()
        with pytest.raises(grpc.RpcError) as refused:
            culprit.result()
    assert replies[-1].WhichOneof("event") == "result"
    assert replies[-1].result.total_frames > 0
    failure = parse_rpc_error(refused.value)
    assert (failure.code, failure.field_name) == (grpc.StatusCode.INVALID_ARGUMENT, "temperature")


@pytest.mark.parametrize("request_id", ["line\nbreak", "caf\u00e9", "tab\tid",
                                        "a" * (MAX_STAGE_REQUEST_ID_CHARS + 1), ""])
def test_a_stage_refuses_a_bad_request_id(stages: dict[str, grpc.Channel],
                                         request_id: str) -> None:
    """Ids travel in metadata and logs: control and non-ASCII characters are refused at every
    stage, naming request_id."""
    call = tokenizer_service_pb2_grpc.TokenizerServiceStub(stages["tokenizer"]).EncodePrompt
    start = tokenizer.EncodePromptStart(request_id=request_id, prompt="a cat")
    with pytest.raises(grpc.RpcError) as error:
        list(call(iter([tokenizer.EncodePromptRequest(start=start)]), timeout=CALL_TIMEOUT_S))
    failure = parse_rpc_error(error.value)
    assert (failure.code, failure.field_name) == (grpc.StatusCode.INVALID_ARGUMENT, "request_id")


@pytest.mark.parametrize(("rate", "samples"), [(48_001, 48_001), (8_001, 8_001),
                                               (48_000, 48_000 * 31)])
def test_the_codec_refuses_odd_rates_and_long_clips(stages: dict[str, grpc.Channel], rate: int,
                                                     samples: int) -> None:
    """A 1 s clip at 48001 Hz asked the resampler for 9.2 GB; odd rates and clips over the
    published `max_reference_seconds` are refused before any resampling."""
    stub = codec_service_pb2_grpc.CodecServiceStub(stages["codec"])
    facts = stub.DescribeCodec(codec.DescribeCodecRequest(), timeout=10)
    assert rate not in facts.reference_sample_rates or samples / rate > facts.max_reference_seconds
    pcm = array_to_proto(np.zeros(samples, np.float32))
    start = codec.EncodeAudioStart(request_id="clip", pcm=pcm, sample_rate=rate)
    with pytest.raises(grpc.RpcError) as error:
        list(stub.EncodeAudio(iter([codec.EncodeAudioRequest(start=start)]),
                              timeout=CALL_TIMEOUT_S))
    failure = parse_rpc_error(error.value)
    assert (failure.code, failure.field_name) == (grpc.StatusCode.INVALID_ARGUMENT, "ref_audio")


def test_the_dit_refuses_an_unknown_execution_mode(stages: dict[str, grpc.Channel]) -> None:
    call = dit_service_pb2_grpc.DitServiceStub(stages["dit"]).Denoise
    start = dit.DenoiseStart(request_id="mode", prompt_embeds=valid_embeddings(stages["tokenizer"]),
                             height=32, width=32, num_inference_steps=2,
                             execution_mode=common_pb2.ExecutionMode.ValueType(7))
    with pytest.raises(grpc.RpcError) as error:
        list(call(iter([dit.DenoiseRequest(start=start)]), timeout=CALL_TIMEOUT_S))
    failure = parse_rpc_error(error.value)
    assert (failure.code, failure.field_name) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                  "execution_mode")
