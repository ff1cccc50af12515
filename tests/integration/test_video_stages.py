"""The video routes over the real stages (tokenizer, DiT, VAE) of the seeded tiny Wan models:
text-to-video (`builtin:wan-t2v-tiny`, Wan 2.1 style) and image-to-video
(`builtin:wan-i2v-tiny`, Wan 2.2 A14B style), with plain httpx against the gateway's REST app.

What is checked: `POST /v1/videos/sync` answers an MP4 that decodes (PyAV) to the requested
frame count and size, for both tasks; a job runs to an MP4 the same way; a job deleted
mid-run stops within a step and the VAE never decodes it (the stages' own metrics say so).
"""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image
from prometheus_client import REGISTRY

from stagemesh.gateway.app import GatewayConfig, open_gateway, run_gateway
from stagemesh.gateway.http.app import build_rest_app
from stagemesh.gateway.recipes import Recipe, StageEndpoint, Task, VideoDefaults
from stagemesh.gateway.videos.store import STORE_ENV
from stagemesh.models.wan import WanVariant, ensure_wan_model
from stagemesh.serve import free_port
from stagemesh.services.registry import build_stage
from stagemesh.shared.stage_runtime import start_stage, stop_stage
from tests.video_forms import form, frames_of

pytestmark = pytest.mark.timeout(120)

#: The DiT allows long requests, so that one can be deleted while it runs.
STAGE_OPTIONS: dict[str, dict[str, object]] = {"dit": {"max_steps": 1000}}
DEFAULTS = VideoDefaults(width=32, height=32, num_frames=5, fps=8, num_inference_steps=2,
                         guidance_scale=5.0)


def metric(name: str, stage: str) -> float:
    """A stage counter summed over its labels (one process holds every stage here)."""
    total = 0.0
    for family in REGISTRY.collect():
        for sample in family.samples:
            if sample.name == name and sample.labels.get("stage") == stage:
                total += sample.value
    return total


@pytest.fixture
async def recipes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                  ) -> AsyncIterator[dict[str, Recipe]]:
    """Real t2v and i2v stages, and their recipes (the store in tmp_path)."""
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "videos"))
    running, recipes = [], {}
    variants: tuple[tuple[Task, WanVariant], ...] = ((Task.TEXT_TO_VIDEO, "t2v"),
                                                     (Task.IMAGE_TO_VIDEO, "i2v"))
    for task, variant in variants:
        folder = ensure_wan_model(variant)
        stages = {}
        for name in ("tokenizer", "dit", "vae"):
            bundle = build_stage(name, folder, STAGE_OPTIONS.get(name))
            server = await start_stage(bundle)
            running.append((bundle, server))
            stages[name] = StageEndpoint(name, f"127.0.0.1:{server.port}")
        recipes[f"wan-{variant}"] = Recipe(f"wan-{variant}", task, str(folder), stages,
                                           video_defaults=DEFAULTS)
    try:
        yield recipes
    finally:
        for bundle, server in running:
            await stop_stage(bundle, server, grace=0.5)


@pytest.fixture
async def client(recipes: dict[str, Recipe]) -> AsyncIterator[httpx.AsyncClient]:
    async with open_gateway(recipes) as core:
        transport = httpx.ASGITransport(app=build_rest_app(core))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw",
                                     timeout=60) as client:
            yield client


def png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 24), (220, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


async def test_sync_text_to_video_decodes_to_the_requested_frames_and_size(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post("/v1/videos/sync", **form(
        prompt="a red circle moving right", size="48x32", num_frames="9", seed="1"))
    assert response.status_code == 200, response.text
    assert response.headers["x-model"] == "wan-t2v"
    assert response.headers["x-request-id"].startswith("video_sync-")
    frames = frames_of(response.content)
    assert len(frames) == 9 and all(f.shape == (32, 48, 3) for f in frames)


async def test_sync_image_to_video_decodes_to_the_requested_frames_and_size(
    client: httpx.AsyncClient,
) -> None:
    fields = form(prompt="the circle moves", size="32x32", seconds="1", fps="4", seed="2")
    fields["files"].append(("input_reference", ("first.png", png(), "image/png")))
    response = await client.post("/v1/videos/sync", **fields)
    assert response.status_code == 200, response.text
    assert response.headers["x-model"] == "wan-i2v"
    frames = frames_of(response.content)
    assert len(frames) == 5 and frames[0].shape == (32, 32, 3)  # 1 s x 4 fps -> 4k+1 = 5


async def test_a_job_makes_the_mp4_it_lists(client: httpx.AsyncClient) -> None:
    job = (await client.post("/v1/videos", **form(prompt="a square", num_frames="5"))).json()
    for _ in range(500):
        done = (await client.get(f"/v1/videos/{job['id']}")).json()
        if done["status"] not in ("queued", "in_progress"):
            break
        await asyncio.sleep(0.02)
    assert done["status"] == "completed", done
    content = await client.get(f"/v1/videos/{job['id']}/content")
    assert len(frames_of(content.content)) == 5


async def test_a_job_deleted_mid_run_stops_within_a_step_and_the_vae_never_decodes_it(
    client: httpx.AsyncClient,
) -> None:
    decoded_before = metric("stagemesh_requests_finished_total", "vae")
    job = (await client.post("/v1/videos", **form(
        prompt="a long one", size="128x128", num_frames="33", num_inference_steps="1000"))).json()
    deadline = time.monotonic() + 30
    while (await client.get(f"/v1/videos/{job['id']}")).json()["progress"] < 1:
        assert time.monotonic() < deadline, "the job never started stepping"
        await asyncio.sleep(0.02)
    steps_before = metric("stagemesh_steps_total", "dit")
    deleted = await client.delete(f"/v1/videos/{job['id']}")  # answers once the DiT stopped
    steps_after = metric("stagemesh_steps_total", "dit")
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert steps_after - steps_before <= 1  # the step in flight at most
    aborted = REGISTRY.get_sample_value("stagemesh_requests_finished_total",
                                        {"stage": "dit", "status": "aborted"})
    assert aborted is not None and aborted >= 1
    assert (await client.get(f"/v1/videos/{job['id']}")).status_code == 404
    await asyncio.sleep(0.5)
    assert metric("stagemesh_steps_total", "dit") == steps_after  # no step since
    assert metric("stagemesh_requests_finished_total", "vae") == decoded_before


@pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the SDK's own notice
async def test_the_openai_sdk_creates_polls_lists_downloads_and_deletes_a_video(
    recipes: dict[str, Recipe],
) -> None:
    """The unmodified openai SDK over real HTTP: create_and_poll, list, download_content,
    delete; stagemesh's own fields ride in extra_body."""
    config = GatewayConfig(http_port=free_port(), grpc_port=free_port())
    ready, stop = asyncio.Event(), asyncio.Event()
    gateway = asyncio.create_task(run_gateway(recipes, config, ready, stop))
    await asyncio.wait_for(ready.wait(), 30)
    sdk = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{config.http_port}/v1",
                             api_key="unused", max_retries=0, timeout=60)
    try:
        video = await sdk.videos.create_and_poll(
            prompt="a red circle moving right", poll_interval_ms=100,
            extra_body={"size": "32x32", "num_frames": 9, "seed": 3})
        assert video.status == "completed" and video.model == "wan-t2v"
        assert [v.id async for v in sdk.videos.list()] == [video.id]
        content = await sdk.videos.download_content(video.id)
        frames = frames_of(content.content)
        assert len(frames) == 9 and frames[0].shape == (32, 32, 3)
        deleted = await sdk.videos.delete(video.id)
        assert deleted.deleted and deleted.id == video.id
        with pytest.raises(openai.NotFoundError):
            await sdk.videos.retrieve(video.id)
    finally:
        await sdk.close()
        stop.set()
        await gateway
