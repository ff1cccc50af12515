"""Image edit over real stages: the Tokenizer (Qwen2.5-VL), DiT and VAE of the seeded tiny
Qwen-Image-Edit folder (`builtin:qwen-image-edit-tiny`), on loopback, behind a real gateway
(REST on uvicorn, gRPC), called with the unmodified openai SDK.

What is checked: `images.edit` returns n images of the requested size; a cancel by id mid-edit
stops the DiT within a step and the VAE never decodes (its engine metrics say so); the
gateway's torch-free copy of the edit size rule agrees with the model family's.
"""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import httpx
import openai
import pytest
import pytest_asyncio
from PIL import Image
from prometheus_client import REGISTRY

from stagemesh.gateway.app import GatewayConfig, run_gateway
from stagemesh.gateway.images.edit_protocol import condition_size
from stagemesh.gateway.recipes import EDIT_DEFAULTS, Recipe, StageEndpoint, Task
from stagemesh.models.families.qwen_image import edit_image_size
from stagemesh.models.qwen_image_edit import ensure_edit_model
from stagemesh.serve import free_port
from stagemesh.services.registry import build_stage
from stagemesh.shared.server import RunningServer
from stagemesh.shared.stage_runtime import StageBundle, start_stage, stop_stage

pytestmark = pytest.mark.timeout(240)
on_module_loop = pytest.mark.asyncio(loop_scope="module")
WaitUntil = Callable[..., Awaitable[None]]

#: The DiT allows long requests, so that one is still denoising when it is cancelled.
STAGE_OPTIONS: dict[str, dict[str, object]] = {"dit": {"max_steps": 1000}}


def finished(stage: str, status: str) -> float:
    """How many requests the engine of `stage` finished with `status` (its /metrics)."""
    value = REGISTRY.get_sample_value("stagemesh_requests_finished_total",
                                      {"stage": stage, "status": status})
    return value or 0.0


def steps(stage: str) -> float:
    return REGISTRY.get_sample_value("stagemesh_steps_total", {"stage": stage}) or 0.0


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 40, 40)).save(buffer, format="PNG")
    return buffer.getvalue()


@dataclass
class Served:
    http_url: str

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.http_url}/v1", api_key="unused",
                                  max_retries=0, timeout=120)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served() -> AsyncIterator[Served]:
    folder = ensure_edit_model()
    running: dict[str, tuple[StageBundle, RunningServer]] = {}
    try:
        for name in ("tokenizer", "dit", "vae"):
            bundle = build_stage(name, folder, STAGE_OPTIONS.get(name))
            running[name] = (bundle, await start_stage(bundle))
        stages = {name: StageEndpoint(name, f"127.0.0.1:{server.port}")
                  for name, (_, server) in running.items()}
        recipe = Recipe("qwen-image-edit-tiny", Task.IMAGE_EDIT, str(folder), stages,
                        EDIT_DEFAULTS)
        config = GatewayConfig(http_port=free_port(), grpc_port=free_port())
        ready, stop = asyncio.Event(), asyncio.Event()
        gateway = asyncio.create_task(run_gateway({recipe.name: recipe}, config, ready, stop))
        await asyncio.wait_for(ready.wait(), 30)
        yield Served(f"http://127.0.0.1:{config.http_port}")
        stop.set()
        await gateway
    finally:
        for bundle, server in running.values():
            await stop_stage(bundle, server, grace=0.5)


@on_module_loop
async def test_the_openai_sdk_edits_an_image_on_the_real_stages(served: Served) -> None:
    decoded = finished("vae", "completed")
    result = await served.client().images.edit(
        model="qwen-image-edit-tiny", image=("red.png", png(48, 32), "image/png"),
        prompt="make it blue", n=2, size="64x32",
        extra_body={"seed": 3, "num_inference_steps": 2})
    assert result.data is not None and len(result.data) == 2
    pixels = []
    for image in result.data:
        assert image.b64_json is not None
        with Image.open(io.BytesIO(base64.b64decode(image.b64_json))) as opened:
            assert opened.size == (64, 32) and opened.mode == "RGB"
            pixels.append(opened.tobytes())
    assert pixels[0] != pixels[1]  # seeds 3 and 4
    assert finished("vae", "completed") == decoded + 2


@on_module_loop
async def test_cancel_by_id_mid_edit_stops_the_dit_and_the_vae_never_decodes(
    served: Served, wait_until: WaitUntil,
) -> None:
    aborted, decoded = finished("dit", "aborted"), finished("vae", "completed")
    encoded, dit_steps = finished("vae-encode", "completed"), steps("dit")
    async with httpx.AsyncClient(base_url=served.http_url, timeout=120) as http:
        edit = asyncio.create_task(http.post(
            "/v1/images/edits", headers={"x-request-id": "edit-cancelled"},
            data={"model": "qwen-image-edit-tiny", "prompt": "make it blue", "size": "32x32",
                  "num_inference_steps": "1000", "seed": "1"},
            files={"image": ("red.png", png(32, 32), "image/png")}))
        await wait_until(lambda: steps("dit") >= dit_steps + 2, timeout=60,
                         what="the DiT denoising the edit")
        cancel = await http.post("/v1/requests/edit-cancelled/cancel")
        response = await edit
    assert cancel.status_code == 200, cancel.text
    outcome = cancel.json()
    assert outcome["stage"] == "dit" and 0 < outcome.get("step_index", 0) < 1000
    assert response.status_code == 499, response.text
    assert finished("dit", "aborted") == aborted + 1
    assert finished("vae-encode", "completed") == encoded + 1  # the input image was encoded
    assert finished("vae", "completed") == decoded  # and nothing was decoded


def test_the_gateways_size_rule_agrees_with_the_model_familys() -> None:
    """The gateway never imports torch, so it keeps its own copy of the rule; this is the
    check that the copy and the owner (which calls diffusers) agree."""
    for size in ((64, 64), (640, 480), (1920, 1080), (33, 17), (100, 700), (7, 3), (1000, 1)):
        assert tuple(edit_image_size(*size)) == condition_size(*size), size


def test_the_gateways_size_rule_agrees_at_a_folders_own_area() -> None:
    """tiny-shapes-edit conditions at 32 x 32 (its condition.json); its VAE publishes that
    area and the gateway sizes the encode by it."""
    for size in ((64, 64), (160, 90), (33, 17), (7, 3), (20, 100)):
        assert tuple(edit_image_size(*size, area=32 * 32)) == condition_size(*size, 32 * 32)
