"""The VAE stage decodes the requests of a step together, each image as it decodes alone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from stagemesh.models import qwen_image
from stagemesh.services.vae import qwen_image_adapter as vae_adapter
from stagemesh.services.vae.qwen_image_adapter import (
    DEFAULT_MAX_RUNNING,
    DecodedImages,
    DecodeState,
    LatentDecoderAdapter,
    LatentsInput,
)
from stagemesh.shared.engine import Completed, EngineMetrics, EngineRequest, StepBudget, StepEngine

#: Images decoded together may differ from images decoded alone by float rounding only.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory) -> LatentDecoderAdapter:
    model_dir: Path = qwen_image.build_tiny_qwen_image(
        tmp_path_factory.mktemp("qwen-image") / "tiny"
    )
    return LatentDecoderAdapter(model_dir)


def _latents(decoder: LatentDecoderAdapter, size: int, seed: int, images: int = 1) -> LatentsInput:
    tokens = (size // decoder.latent_factor) ** 2
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(images, tokens, decoder.vae.config.z_dim * 4, generator=generator)
    return LatentsInput(latents, size, size)


def _decode_in_one_step(
    decoder: LatentDecoderAdapter, payloads: Sequence[LatentsInput]
) -> list[DecodedImages]:
    states = [
        decoder.prepare(EngineRequest(request_id=f"r{i}", payload=payload))
        for i, payload in enumerate(payloads)
    ]
    outputs = decoder.step(states)
    assert all(out.finished for out in outputs)
    return [decoder.finish(state) for state in states]


def _assert_same(got: DecodedImages, want: DecodedImages) -> None:
    assert got.images.shape == want.images.shape
    assert float(np.abs(got.images - want.images).max()) <= TOLERANCE
    assert int(np.abs(got.pixels.astype(np.int16) - want.pixels.astype(np.int16)).max()) <= 1


def _counting_decodes(
    decoder: LatentDecoderAdapter, monkeypatch: pytest.MonkeyPatch
) -> list[int]:
    """The batch size of every decoder forward from now on."""
    batches: list[int] = []
    decode: Callable[..., object] = decoder.vae.decode

    def counted(latents: torch.Tensor, **kwargs: object) -> object:
        batches.append(latents.shape[0])
        return decode(latents, **kwargs)

    monkeypatch.setattr(decoder.vae, "decode", counted)
    return batches


def test_a_step_decodes_its_requests_together_each_as_alone(
    decoder: LatentDecoderAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    payloads = [_latents(decoder, 64, seed) for seed in range(3)]
    payloads.append(_latents(decoder, 64, 7, images=2))  # a request of two images
    alone = [decoder.decode(payload) for payload in payloads]
    batches = _counting_decodes(decoder, monkeypatch)
    together = _decode_in_one_step(decoder, payloads)
    assert batches == [5]  # one forward for the five images of the four requests
    for got, want in zip(together, alone, strict=True):
        _assert_same(got, want)
    assert together[3].pixels.shape[0] == 2
    assert len({got.pixels.tobytes() for got in together}) == 4  # no request got another's


def test_the_pixel_budget_splits_a_step_into_several_forwards(
    decoder: LatentDecoderAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vae_adapter, "MAX_PIXELS_PER_DECODE", 2 * 64 * 64)
    payloads = [_latents(decoder, 64, seed) for seed in range(5)]
    payloads.insert(2, _latents(decoder, 64, 9, images=3))  # above the budget: alone
    alone = [decoder.decode(payload) for payload in payloads]
    batches = _counting_decodes(decoder, monkeypatch)
    together = _decode_in_one_step(decoder, payloads)
    assert batches == [2, 3, 2, 1]  # in order, never over the budget unless alone
    for got, want in zip(together, alone, strict=True):
        _assert_same(got, want)


def test_sizes_decode_in_separate_forwards(
    decoder: LatentDecoderAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    payloads = [_latents(decoder, 64, 1), _latents(decoder, 32, 2), _latents(decoder, 32, 3)]
    alone = [decoder.decode(payload) for payload in payloads]
    batches = _counting_decodes(decoder, monkeypatch)
    together = _decode_in_one_step(decoder, payloads)
    assert batches == [1, 2]
    for got, want in zip(together, alone, strict=True):
        _assert_same(got, want)


async def test_the_engine_decodes_requests_sent_together_in_one_step(
    decoder: LatentDecoderAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    step = decoder.step

    def recording_step(states: Sequence[DecodeState]) -> object:
        calls.append(len(states))
        return step(states)

    monkeypatch.setattr(decoder, "step", recording_step)
    engine = StepEngine(
        decoder, max_running=DEFAULT_MAX_RUNNING, metrics=EngineMetrics("vae", CollectorRegistry())
    )
    streams = [
        engine.submit(EngineRequest(f"r{seed}", _latents(decoder, 64, seed), StepBudget(1)))
        for seed in range(4)
    ]
    engine.start()  # after the submits: its first tick sees them all
    try:
        for stream in streams:
            events = [event async for event in stream]
            assert isinstance(events[-1], Completed)
    finally:
        await asyncio.to_thread(engine.shutdown, True, 10)
    assert calls == [4]
