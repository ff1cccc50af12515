"""The DiT stage's batching options: defaults that batch, recipe overrides, truthful Describe."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from stagemesh.services.dit.servicer import WIRE
from stagemesh.services.registry import build_stage
from stagemesh.shared.proto.v1 import dit_service_pb2, dit_service_pb2_grpc
from stagemesh.shared.stage_runtime import start_stage, stop_stage
from stagemesh.shared.torch_tensors import to_proto

pytestmark = pytest.mark.timeout(120)


async def _describe(options: dict[str, object], model_dir: Path) -> tuple[int, int, int]:
    """(engine max_running, engine max_batch, Describe's max_running) of a stage built with
    `options` and served on loopback."""
    bundle = build_stage("dit", model_dir, options)
    (engine,) = bundle.engines
    server = await start_stage(bundle)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = dit_service_pb2_grpc.DitServiceStub(channel)
            described = await stub.DescribeDit(dit_service_pb2.DescribeDitRequest())
    finally:
        await stop_stage(bundle, server, grace=0.5)
    return engine.max_running, engine.max_batch, described.stage.max_running


async def test_the_dit_batches_out_of_the_box(tiny_model_dir: Path) -> None:
    assert await _describe({}, tiny_model_dir) == (16, 8, 16)


async def test_recipe_options_set_the_batch(tiny_model_dir: Path) -> None:
    assert await _describe({"max_batch": 2, "max_running": 3}, tiny_model_dir) == (3, 2, 3)
    # a batch larger than the holders is capped by them
    assert await _describe({"max_batch": 8, "max_running": 1}, tiny_model_dir) == (1, 1, 1)


@pytest.mark.parametrize(
    "options",
    [{"max_batch": 0}, {"max_batch": 2.5}, {"max_batch": True}, {"max_running": 0}],
)
def test_bad_batch_options_are_refused_at_start_up(
    tiny_model_dir: Path, options: dict[str, object]
) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        build_stage("dit", tiny_model_dir, options)


def test_priority_reaches_the_engine_request() -> None:
    start = dit_service_pb2.DenoiseStart(
        request_id="r", prompt_embeds=to_proto(torch.zeros(1, 3, 8)), height=32, width=32,
        num_inference_steps=2, seed=0, priority=-3,
    )
    request = WIRE.make_request(dit_service_pb2.DenoiseRequest(start=start), None)
    assert request.priority == -3
    unset = dit_service_pb2.DenoiseStart(request_id="r", prompt_embeds=start.prompt_embeds)
    assert WIRE.make_request(dit_service_pb2.DenoiseRequest(start=unset), None).priority == 0


async def test_the_step_cache_options_are_published(tiny_model_dir: Path) -> None:
    options = {"step_cache": "first_block", "step_cache_threshold": 0.2,
               "step_cache_warmup_steps": 2, "step_cache_max_skips": 4,
               "max_step_cache_threshold": 0.4}
    bundle = build_stage("dit", tiny_model_dir, options)
    server = await start_stage(bundle)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = dit_service_pb2_grpc.DitServiceStub(channel)
            described = await stub.DescribeDit(dit_service_pb2.DescribeDitRequest())
    finally:
        await stop_stage(bundle, server, grace=0.5)
    assert described.step_cache == "first_block"
    assert described.step_cache_threshold == pytest.approx(0.2)
    assert described.max_step_cache_threshold == pytest.approx(0.4)
    assert (described.step_cache_warmup_steps, described.step_cache_final_steps,
            described.step_cache_max_skips, described.step_cache_interval) == (2, 1, 4, 5)
    assert described.step_cache_bytes_per_row > 0
    assert bundle.info["step_cache"] == "first_block"


def test_a_bare_yaml_off_turns_the_cache_off(tiny_model_dir: Path) -> None:
    """`step_cache: off` unquoted in a recipe reaches the stage as false (YAML 1.1)."""
    assert build_stage("dit", tiny_model_dir, {"step_cache": False}).info["step_cache"] == "off"


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"step_cache": "teacache"}, "step_cache"),
        ({"step_cache": True}, "step_cache"),
        ({"step_cache": "first_block", "step_cache_threshold": 0.9}, "step_cache_threshold"),
        ({"step_cache_interval": 0}, "step_cache_interval"),
        ({"max_step_cache_threshold": 2.0}, "max_step_cache_threshold"),
        # every running request's cache must fit in half the free memory
        ({"step_cache": "first_block", "max_running": 10**9}, "max_running"),
    ],
)
def test_bad_step_cache_options_are_refused_at_start_up(
    tiny_model_dir: Path, options: dict[str, object], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        build_stage("dit", tiny_model_dir, options)


def test_the_request_threshold_reaches_the_adapter() -> None:
    start = dit_service_pb2.DenoiseStart(
        request_id="r", prompt_embeds=to_proto(torch.zeros(1, 3, 8)), height=32, width=32,
        num_inference_steps=2, seed=0, step_cache_threshold=0.0,
    )
    request = WIRE.make_request(dit_service_pb2.DenoiseRequest(start=start), None)
    assert request.payload.step_cache_threshold == 0.0  # set: off for this request
    start.ClearField("step_cache_threshold")
    request = WIRE.make_request(dit_service_pb2.DenoiseRequest(start=start), None)
    assert request.payload.step_cache_threshold is None  # unset: the stage's setting
