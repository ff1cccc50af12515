"""The DiT stage's LoRA options and wire: Describe publishes the adapters, a request names them
(`lora` on DenoiseStart), a bad name is INVALID_ARGUMENT naming `lora`, bad options fail at
start-up."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformer2DModel

from stagemesh.services.dit.servicer import NO_LORAS, WIRE, _describe_loras
from stagemesh.services.registry import build_stage
from stagemesh.shared.errors import parse_rpc_error
from stagemesh.shared.proto.v1 import common_pb2, dit_service_pb2, dit_service_pb2_grpc
from stagemesh.shared.stage_runtime import start_stage, stop_stage
from stagemesh.shared.torch_tensors import to_proto
from tests.lora_files import write_adapter

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def lora_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loras")
    transformer = QwenImageTransformer2DModel.from_pretrained(
        tiny_model_dir, subfolder="transformer", local_files_only=True
    )
    write_adapter(transformer, root, "ink", 4, 1, alpha=8)
    write_adapter(transformer, root, "wax", 2, 2, bare=True)
    return root


def _start(dim: int, rid: str, lora: list[common_pb2.LoraAdapter]) -> dit_service_pb2.DenoiseStart:
    return dit_service_pb2.DenoiseStart(
        request_id=rid, prompt_embeds=to_proto(torch.randn(1, 5, dim)), height=32, width=32,
        num_inference_steps=2, seed=1, lora=lora,
    )  # fmt: skip


async def test_adapters_are_published_and_named_per_request(
    tiny_model_dir: Path, lora_dir: Path
) -> None:
    options = {"lora_dir": str(lora_dir), "max_loras": 3, "max_lora_rank": 8,
               "max_loras_per_request": 2, "max_lora_scale": 2.0}  # fmt: skip
    bundle = build_stage("dit", tiny_model_dir, options)
    server = await start_stage(bundle)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = dit_service_pb2_grpc.DitServiceStub(channel)
            described = await stub.DescribeDit(dit_service_pb2.DescribeDitRequest())
            config = QwenImageTransformer2DModel.load_config(tiny_model_dir / "transformer")
            dim = int(config["joint_attention_dim"])
            ok = [
                common_pb2.LoraAdapter(name="ink", scale=-1.5),
                common_pb2.LoraAdapter(name="wax"),
            ]
            kinds = [
                response.WhichOneof("event")
                async for response in stub.Denoise(
                    iter([dit_service_pb2.DenoiseRequest(start=_start(dim, "ok", ok))])
                )
            ]
            assert kinds[-1] == "result"
            for bad in (
                [common_pb2.LoraAdapter(name="nope")],
                [common_pb2.LoraAdapter(name="ink", scale=2.5)],
                [*ok, *ok[:1]],
            ):
                with pytest.raises(grpc.aio.AioRpcError) as failure:
                    async for _ in stub.Denoise(
                        iter([dit_service_pb2.DenoiseRequest(start=_start(dim, "bad", bad))])
                    ):
                        pass
                error = parse_rpc_error(failure.value)
                assert error.code is grpc.StatusCode.INVALID_ARGUMENT
                assert error.field_name == "lora"
    finally:
        await stop_stage(bundle, server, grace=0.5)
    assert list(described.lora_names) == ["ink", "wax"]
    assert (described.max_loras, described.max_lora_rank) == (3, 8)
    assert described.max_loras_per_request == 2
    assert described.max_lora_scale == pytest.approx(2.0)


def test_a_stage_without_lora_dir_publishes_none() -> None:
    description = dit_service_pb2.DescribeDitResponse()
    _describe_loras(description, NO_LORAS)
    assert description == dit_service_pb2.DescribeDitResponse()


def test_an_unset_scale_is_one() -> None:
    start = _start(8, "r", [common_pb2.LoraAdapter(name="ink"),
                            common_pb2.LoraAdapter(name="wax", scale=0.0)])  # fmt: skip
    request = WIRE.make_request(dit_service_pb2.DenoiseRequest(start=start), None)
    assert [(u.name, u.scale) for u in request.payload.lora] == [("ink", 1.0), ("wax", 0.0)]


@pytest.mark.parametrize(
    ("options", "named"),
    [({"max_loras": 0}, "max_loras"), ({"max_lora_rank": 0}, "max_lora_rank"),
     ({"max_loras": 2, "max_loras_per_request": 3}, "max_loras_per_request"),
     ({"max_lora_scale": -1.0}, "max_lora_scale"),
     ({"lora_dir": "/nonexistent/loras"}, "lora_dir")],
)  # fmt: skip
def test_bad_lora_options_are_refused_at_start_up(
    tiny_model_dir: Path, options: dict[str, object], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        build_stage("dit", tiny_model_dir, options)
