"""The speech stages (Talker, Codec) in reduced precision on the CPU, against the stock models in
the same dtype.

What must hold in every dtype, and how close:

- Talker: its frames are discrete codes, so there is no tolerance to state: greedy decoding
  equals `CsmForConditionalGeneration.generate` in the same dtype exactly (up to where generate
  starts sampling ids past the codec's codebook, as in float32), and a request batched with
  another gives exactly its frames alone (the batched forward masks the padding; every row is
  the same arithmetic as alone, which measured exact in bfloat16 and float16 too).
- Codec: one-shot decode equals `MimiModel.decode` in the same dtype exactly (the same call);
  streamed chunks (with 25 frames of left context) equal the one-shot decode to within one
  unit in the last place of the dtype at the signal's peak, `finfo(dtype).eps * peak`: a seam
  may round an output sample differently, it must never drift (measured: 0 in bfloat16, one
  ulp in float16). PCM leaves as float32 and codes as int64 whatever the dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoProcessor

from stagemesh.models.speech import ensure_speech_model
from stagemesh.services.codec.csm_adapter import (
    CodecDecoderAdapter,
    CodecEncoderAdapter,
    DecodeInput,
    EncodeInput,
)
from stagemesh.services.talker.csm_adapter import SamplingParams, TalkerAdapter, TalkerInput
from stagemesh.shared.devices import Placement
from stagemesh.shared.engine.adapter import EngineRequest

REDUCED = [torch.bfloat16, torch.float16]


def _placement(dtype: torch.dtype) -> Placement:
    return Placement(torch.device("cpu"), dtype)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_speech_model()


@pytest.fixture(scope="module", params=REDUCED, ids=str)
def talker(request: pytest.FixtureRequest, model_dir: Path) -> TalkerAdapter:
    return TalkerAdapter(model_dir, placement=_placement(request.param))


@pytest.fixture(scope="module", params=REDUCED, ids=str)
def decoder(request: pytest.FixtureRequest, model_dir: Path) -> CodecDecoderAdapter:
    return CodecDecoderAdapter(model_dir, placement=_placement(request.param))


def _run_alone(talker: TalkerAdapter, payload: TalkerInput) -> torch.Tensor:
    state = talker.prepare(EngineRequest(request_id="alone", payload=payload))
    frames = []
    for _ in range(state.max_new_frames):
        out = talker.step([state])[0]
        frames.append(out.partial)
        if out.finished:
            break
    talker.release(state)
    return torch.stack(frames)


def test_the_talker_computes_in_its_dtype_and_sends_int64_codes(talker: TalkerAdapter) -> None:
    dtype = talker.placement.dtype
    assert {p.dtype for p in talker._model.parameters()} == {dtype}
    state = talker.prepare(EngineRequest(request_id="r", payload=TalkerInput(
        text="Hi.", sampling=SamplingParams(seed=0), max_new_frames=2)))
    assert state.cache is not None and state.cache.layers[0].keys.dtype == dtype
    frame = talker.step([state])[0].partial
    assert frame is not None and frame.dtype == torch.int64 and frame.device.type == "cpu"
    talker.release(state)


def test_greedy_equals_generate_in_the_same_dtype(talker: TalkerAdapter, model_dir: Path) -> None:
    payload = TalkerInput(text="Hello world.", voice="ryan", sampling=SamplingParams(temperature=0),
                          max_new_frames=10, stop_on_end_of_audio=False)
    ours = _run_alone(talker, payload)
    processor: Any = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
    inputs = processor(text="<|im_start|>[1]Hello world.<|im_end|>", return_tensors="pt")
    model = talker._model
    theirs = model.generate(input_ids=inputs.input_ids, do_sample=False,
                            depth_decoder_do_sample=False, max_new_tokens=10)[0]
    codec_vocab = model.config.codec_config.codebook_size
    out_of_codebook = (theirs >= codec_vocab).any(dim=-1).nonzero()
    agree = int(out_of_codebook[0]) if out_of_codebook.numel() else theirs.shape[0]
    assert agree >= 2
    assert torch.equal(ours[:agree], theirs[:agree])


def test_batched_requests_equal_each_alone(talker: TalkerAdapter) -> None:
    a = TalkerInput(text="Hello world.", voice="ryan", sampling=SamplingParams(seed=1),
                    max_new_frames=8)
    b = TalkerInput(text="A longer second sentence, with more tokens.", voice="serena",
                    sampling=SamplingParams(seed=2, top_p=0.8, top_k=20, temperature=1.1),
                    max_new_frames=5)
    alone = {"a": _run_alone(talker, a), "b": _run_alone(talker, b)}
    frames: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    live = [talker.prepare(EngineRequest(request_id="a", payload=a))]
    for tick in range(10):
        if tick == 2:  # b joins mid-generation
            live.append(talker.prepare(EngineRequest(request_id="b", payload=b)))
        for state, out in zip(live, talker.step(live), strict=True):
            frames[state.request_id].append(out.partial)
        live = [s for s in live if len(frames[s.request_id]) < s.max_new_frames]
        if not live:
            break
    for name, want in alone.items():
        assert torch.equal(torch.stack(frames[name]), want), name


def _decode(decoder: CodecDecoderAdapter, codes: torch.Tensor) -> list[torch.Tensor]:
    state = decoder.prepare(EngineRequest(request_id="d", payload=DecodeInput(
        frames=codes, final=True)))
    chunks = []
    while True:
        out = decoder.step([state])[0]
        if out.partial is not None:
            chunks.append(out.partial)
        if out.finished:
            break
    decoder.release(state)
    return chunks


def test_streamed_decode_equals_the_stock_one_shot_to_one_ulp(
    decoder: CodecDecoderAdapter,
) -> None:
    dtype = decoder.placement.dtype
    codes = torch.randint(0, 64, (63, 8), generator=torch.Generator().manual_seed(0))
    chunks = _decode(decoder, codes)
    assert len(chunks) > 1 and all(c.dtype == torch.float32 for c in chunks)
    with torch.inference_mode():
        stock = decoder._codec.decode(codes.T[None]).audio_values[0, 0]
    assert stock.dtype == dtype
    peak = float(stock.abs().max())
    streamed = torch.cat(chunks)
    assert streamed.shape == stock.shape
    assert float((streamed - stock.float()).abs().max()) <= torch.finfo(dtype).eps * peak
    # the first chunk has no context: it is the stock decode of its frames, exactly
    with torch.inference_mode():
        first = decoder._codec.decode(codes[:5].T[None]).audio_values[0, 0]
    assert torch.equal(chunks[0], first.float())


@pytest.mark.parametrize("dtype", REDUCED, ids=str)
def test_the_encoder_gives_int64_codes_of_the_stock_encode(
    model_dir: Path, dtype: torch.dtype
) -> None:
    encoder = CodecEncoderAdapter(model_dir, placement=_placement(dtype))
    audio = 0.3 * torch.randn(24_000, generator=torch.Generator().manual_seed(0))
    state = encoder.prepare(EngineRequest(request_id="e", payload=EncodeInput(audio, 24_000)))
    encoder.step([state])
    codes = encoder.finish(state)
    assert codes.dtype == torch.int64 and codes.shape == (13, 8)
    with torch.inference_mode():
        stock = encoder._codec.encode(audio.to(dtype).view(1, 1, -1), num_quantizers=8)
    assert torch.equal(codes, stock.audio_codes[0].T)
