"""The video routes over fake video stages: in-process grpc.aio servers that publish Wan-like
facts (frames 4k+1, one or two transformers) and answer like the real stages (the DiT steps and
honours a Cancel, the VAE streams decoded frames in chunks and encodes an input image), with a
real gateway (REST app, gRPC servicer, video store on disk) over them.

What is checked: every route with plain httpx (create, get, list, content, delete, sync, the
native /v1/videoJobs routes) and gRPC; the MP4 decodes (PyAV) to the requested frame count and
size; a job deleted mid-run stops within a step and the VAE never decodes it; a queued job that
is deleted never starts; another gateway sharing the store can delete a job; a job left running
by a gateway that stopped reads back as failed; owners see only their jobs; the seed's errors.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import av
import grpc
import httpx
import numpy as np
import pytest
from PIL import Image

from stagemesh.gateway.app import open_gateway
from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.http.app import build_rest_app
from stagemesh.gateway.recipes import Recipe, StageEndpoint, Task, VideoDefaults
from stagemesh.gateway.videos.store import STORE_ENV
from stagemesh.gateway.wire.auth import ApiKeys
from stagemesh.shared.proto.v1 import (
    common_pb2,
    dit_service_pb2,
    dit_service_pb2_grpc,
    gateway_service_pb2,
    vae_service_pb2,
    vae_service_pb2_grpc,
)
from stagemesh.shared.tensors import array_from_proto, array_to_proto
from tests.integration.fake_stages import (
    FakeTokenizer,
    cancel_watch,
    gateway_stub,
    serve_fakes,
    start_message,
    stop_all,
)

pytestmark = pytest.mark.timeout(60)

CHUNK_FRAMES = 4
FORM = {"prompt": "a red circle moving right", "size": "48x32", "num_frames": "9", "fps": "8",
        "num_inference_steps": "3", "seed": "7"}


@dataclass
class FakeVideoDit(dit_service_pb2_grpc.DitServiceServicer):
    """Steps `step_seconds` apart; a Cancel stops it before its next step (aborted)."""

    image_to_video: bool = False
    step_seconds: float = 0.0
    max_preview_size: int = 32  # previews: a 4 x 6 picture whose grey level is the step
    starts: list[Any] = field(default_factory=list)
    aborted: dict[str, int] = field(default_factory=dict)  # request id -> steps done
    steps_done: dict[str, int] = field(default_factory=dict)

    async def DescribeDit(self, request: Any, context: Any) -> Any:
        return dit_service_pb2.DescribeDitResponse(
            stage=common_pb2.StageDescription(stage="dit"), size_multiple=16, max_side=64,
            max_pixels=64 * 64, max_steps=20, max_true_cfg_scale=10.0, max_images_per_request=1,
            min_steps=1, execution_modes=[common_pb2.EXECUTION_MODE_STEP], max_frames=33,
            frame_multiple=4, max_condition_images=1 if self.image_to_video else 0,
            has_second_transformer=self.image_to_video, accepts_flow_shift=True,
            task="image-to-video" if self.image_to_video else "text-to-video",
            max_preview_size=self.max_preview_size, default_preview_size=16,
            min_preview_every=1)

    async def Denoise(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        start = await start_message(requests)
        self.starts.append(start)
        try:
            async with cancel_watch(requests) as cancelled:
                yield dit_service_pb2.DenoiseResponse(queued=common_pb2.Queued(position=0))
                for step in range(start.num_inference_steps):
                    await asyncio.sleep(self.step_seconds)
                    if cancelled.is_set():
                        self.aborted[start.request_id] = step
                        yield dit_service_pb2.DenoiseResponse(
                            aborted=common_pb2.Aborted(step_index=step))
                        return
                    self.steps_done[start.request_id] = step + 1
                    yield dit_service_pb2.DenoiseResponse(progress=common_pb2.Progress(
                        step_index=step + 1, total_steps=start.num_inference_steps))
                    if start.preview.every and (step + 1) % start.preview.every == 0:
                        yield dit_service_pb2.DenoiseResponse(preview=common_pb2.Preview(
                            step_index=step + 1, width=6, height=4, pixels=array_to_proto(
                                np.full((4, 6, 3), 40 * (step + 1), np.uint8))))
                yield dit_service_pb2.DenoiseResponse(result=dit_service_pb2.DenoiseResult(
                    latents=array_to_proto(np.zeros((1, 4, 3, 2, 2), np.float32)),
                    height=start.height, width=start.width, steps=start.num_inference_steps,
                    num_frames=start.num_frames))
        except asyncio.CancelledError:  # the gateway cancelled the RPC
            self.aborted.setdefault(start.request_id, self.steps_done.get(start.request_id, 0))
            raise


@dataclass
class FakeVideoVae(vae_service_pb2_grpc.VaeServiceServicer):
    """Decodes to flat frames whose grey level says their index, CHUNK_FRAMES at a time."""

    decoded: list[str] = field(default_factory=list)
    encoded: list[Any] = field(default_factory=list)

    async def DescribeVae(self, request: Any, context: Any) -> Any:
        return vae_service_pb2.DescribeVaeResponse(
            stage=common_pb2.StageDescription(stage="vae"), size_multiple=16, max_side=64,
            can_encode=True, max_frames=33)

    async def DecodeLatents(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        start = (await anext(aiter(requests))).start
        self.decoded.append(start.request_id)
        for first in range(0, start.num_frames, CHUNK_FRAMES):
            count = min(CHUNK_FRAMES, start.num_frames - first)
            levels = (np.arange(first, first + count) * 20 + 20).astype(np.uint8)
            pixels = np.broadcast_to(levels[:, None, None, None],
                                     (count, start.height, start.width, 3))
            yield vae_service_pb2.DecodeLatentsResponse(frames=vae_service_pb2.DecodedFrames(
                pixels=array_to_proto(np.ascontiguousarray(pixels)), first_frame_index=first))
        yield vae_service_pb2.DecodeLatentsResponse(
            result=vae_service_pb2.DecodeLatentsResult(num_frames=start.num_frames))

    async def EncodeImage(self, requests: Any, context: Any) -> AsyncIterator[Any]:
        start = (await anext(aiter(requests))).start
        self.encoded.append(start)
        latent_frames = (start.num_frames - 1) // 4 + 1
        yield vae_service_pb2.EncodeImageResponse(result=vae_service_pb2.EncodeImageResult(
            latents=array_to_proto(np.ones((1, 4, latent_frames, 2, 3), np.float32))))


@dataclass
class VideoMesh:
    dit: FakeVideoDit
    i2v_dit: FakeVideoDit
    vae: FakeVideoVae
    recipes: dict[str, Recipe]
    store: Path
    core: GatewayCore
    client: httpx.AsyncClient


def video_recipes(address: dict[str, str]) -> dict[str, Recipe]:
    def endpoints(dit: str) -> dict[str, StageEndpoint]:
        return {"tokenizer": StageEndpoint("tokenizer", address["tokenizer"]),
                "dit": StageEndpoint("dit", address[dit]),
                "vae": StageEndpoint("vae", address["vae"])}

    defaults = VideoDefaults(width=32, height=32, num_frames=5, fps=8, num_inference_steps=2,
                             guidance_scale=5.0)
    return {"t2v": Recipe("t2v", Task.TEXT_TO_VIDEO, "m", endpoints("dit"),
                          video_defaults=defaults),
            "i2v": Recipe("i2v", Task.IMAGE_TO_VIDEO, "m", endpoints("i2v-dit"),
                          video_defaults=defaults)}


@pytest.fixture
async def stages() -> AsyncIterator[tuple[dict[str, Any], dict[str, str]]]:
    servicers: dict[str, Any] = {"tokenizer": FakeTokenizer(max_prompt_chars=200),
                                 "dit": FakeVideoDit(),
                                 "i2v-dit": FakeVideoDit(image_to_video=True),
                                 "vae": FakeVideoVae()}
    servers, address = await serve_fakes(servicers)
    try:
        yield servicers, address
    finally:
        await stop_all(servers)


@pytest.fixture
async def mesh(stages: tuple[dict[str, Any], dict[str, str]], tmp_path: Path,
               monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[VideoMesh]:
    servicers, address = stages
    monkeypatch.setenv(STORE_ENV, str(tmp_path / "store"))
    recipes = video_recipes(address)
    async with open_gateway(recipes) as core:
        transport = httpx.ASGITransport(app=build_rest_app(core))
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            yield VideoMesh(servicers["dit"], servicers["i2v-dit"], servicers["vae"], recipes,
                            tmp_path / "store", core, client)


def multipart(fields: dict[str, str], files: dict[str, bytes] | None = None) -> dict[str, Any]:
    """httpx arguments for a multipart form (what the openai SDK sends)."""
    parts: list[tuple[str, tuple[str | None, bytes, str]]] = [
        (name, (None, value.encode(), "text/plain")) for name, value in fields.items()]
    parts += [(name, (f"{name}.png", data, "image/png")) for name, data in (files or {}).items()]
    return {"files": parts}


def png(width: int = 40, height: int = 24) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def mp4_frames(data: bytes) -> list[np.ndarray]:
    with av.open(io.BytesIO(data), "r") as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


async def wait_for(client: httpx.AsyncClient, job_id: str, *statuses: str,
                   progress_over: int = -1) -> dict[str, Any]:
    for _ in range(400):
        body: dict[str, Any] = (await client.get(f"/v1/videos/{job_id}")).json()
        if body.get("status") in statuses and body.get("progress", 0) > progress_over:
            return body
        await asyncio.sleep(0.02)
    raise AssertionError(f"job {job_id} never reached {statuses}: {body}")


# -- sync ----------------------------------------------------------------------------------------

async def test_sync_returns_an_mp4_of_the_requested_frames_and_size(mesh: VideoMesh) -> None:
    response = await mesh.client.post("/v1/videos/sync", **multipart(FORM))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "video/mp4"
    assert response.headers["x-request-id"].startswith("video_sync-")
    assert response.headers["x-model"] == "t2v"
    assert float(response.headers["x-inference-time-s"]) >= 0
    frames = mp4_frames(response.content)
    assert len(frames) == 9 and all(f.shape == (32, 48, 3) for f in frames)
    assert [abs(int(np.median(f)) - (20 * i + 20)) <= 3 for i, f in enumerate(frames)] == \
        [True] * 9  # the frames in the order the VAE decoded them
    start = mesh.dit.starts[-1]
    assert (start.num_frames, start.width, start.height, start.seed) == (9, 48, 32, 7)
    assert not list(mesh.store.glob("*/*.json"))  # the sync route stores nothing


async def test_an_urlencoded_form_works_as_curl_d_sends_it(mesh: VideoMesh) -> None:
    response = await mesh.client.post("/v1/videos/sync", data=FORM)  # no file: urlencoded
    assert response.status_code == 200, response.text
    assert len(mp4_frames(response.content)) == 9
    start = mesh.dit.starts[-1]
    assert (start.num_frames, start.width, start.height, start.seed) == (9, 48, 32, 7)
    created = await mesh.client.post("/v1/videos", content=urlencode(FORM), headers={
        "content-type": "application/x-www-form-urlencoded; charset=utf-8"})
    assert created.status_code == 200 and created.json()["status"] == "queued", created.text
    unknown = await mesh.client.post("/v1/videos/sync", data={**FORM, "colour": "red"})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "colour"


async def test_sync_passes_the_sampling_params_through(mesh: VideoMesh) -> None:
    form = {**FORM, "num_inference_steps": "5", "guidance_scale": "6.5", "seed": "42",
            "negative_prompt": "blur", "flow_shift": "3", "step_cache_threshold": "0"}
    response = await mesh.client.post("/v1/videos/sync", **multipart(form))
    assert response.status_code == 200, response.text
    start = mesh.dit.starts[-1]
    assert (start.num_inference_steps, start.true_cfg_scale, start.seed) == (5, 6.5, 42)
    assert start.HasField("flow_shift") and start.flow_shift == 3.0
    assert start.HasField("step_cache_threshold") and start.step_cache_threshold == 0.0
    assert not start.HasField("guidance_scale_2") and not start.HasField("boundary_ratio")


@pytest.mark.parametrize("how", ["input_reference", "image_reference"])
async def test_sync_image_to_video_takes_a_file_or_a_data_url(mesh: VideoMesh, how: str) -> None:
    form = {**FORM, "guidance_scale_2": "3.5", "boundary_ratio": "0.875"}
    files = None
    if how == "input_reference":
        files = {"input_reference": png()}
    else:
        url = "data:image/png;base64," + base64.b64encode(png()).decode()
        form["image_reference"] = json.dumps({"image_url": url})
    response = await mesh.client.post("/v1/videos/sync", **multipart(form, files))
    assert response.status_code == 200, response.text
    assert response.headers["x-model"] == "i2v"  # an input image picks the i2v recipe
    assert len(mp4_frames(response.content)) == 9
    encoded = mesh.vae.encoded[-1]
    assert array_from_proto(encoded.image).shape == (24, 40, 3)  # as the client sent it
    assert (encoded.width, encoded.height, encoded.num_frames) == (48, 32, 9)
    start = mesh.i2v_dit.starts[-1]
    assert len(start.condition_latents) == 1
    assert (start.guidance_scale_2, start.boundary_ratio) == (3.5, 0.875)


@pytest.mark.parametrize(("form", "files", "param"), [
    ({"size": "48x32"}, None, "prompt"),
    ({**FORM, "num_frames": "8"}, None, "num_frames"),
    ({**FORM, "num_frames": "37"}, None, "num_frames"),
    ({**FORM, "guidance_scale_2": "2"}, None, "guidance_scale_2"),
    ({**FORM, "boundary_ratio": "0.5"}, None, "boundary_ratio"),
    ({**FORM, "size": "50x32"}, None, "size"),
    ({**FORM, "model": "nope"}, None, "model"),
    ({**FORM, "model": "t2v"}, {"input_reference": png()}, "input_reference"),
    ({**FORM, "image_reference": json.dumps({"image_url": "https://x.test/a.png"})}, None,
     "image_reference"),
    ({**FORM, "image_reference": json.dumps({"image_url": "data:image/png;base64,"
                                             + base64.b64encode(png()).decode()})},
     {"input_reference": png()}, "image_reference"),
    ({**FORM, "model": "i2v"}, None, "input_reference"),
    ({**FORM, "colour": "red"}, None, "colour"),
    ({**FORM, "step_cache_threshold": "0.1"}, None, "step_cache_threshold"),  # the DiT has none
])
async def test_the_seeds_error_cases_are_400s_naming_the_field(
    mesh: VideoMesh, form: dict[str, str], files: dict[str, bytes] | None, param: str,
) -> None:
    for route in ("/v1/videos/sync", "/v1/videos"):
        response = await mesh.client.post(route, **multipart(form, files))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    assert not mesh.dit.starts and not mesh.i2v_dit.starts  # no stage ran


# -- jobs ----------------------------------------------------------------------------------------

async def test_a_job_is_created_polled_listed_downloaded_and_deleted(mesh: VideoMesh) -> None:
    created = await mesh.client.post("/v1/videos", **multipart(FORM))
    assert created.status_code == 200, created.text
    job = created.json()
    assert job["object"] == "video" and job["status"] in ("queued", "in_progress")
    assert job["id"].startswith("video_") and created.headers["x-request-id"] == job["id"]
    assert (job["size"], job["seconds"], job["model"]) == ("48x32", "1.125", "t2v")
    polled = await mesh.client.get(f"/v1/videos/{job['id']}")
    if polled.json()["status"] in ("queued", "in_progress"):
        assert polled.headers["openai-poll-after-ms"] == "500"
    done = await wait_for(mesh.client, job["id"], "completed")
    assert done["progress"] == 100 and done["completed_at"] >= done["created_at"]

    listed = (await mesh.client.get("/v1/videos")).json()
    assert listed["object"] == "list" and [v["id"] for v in listed["data"]] == [job["id"]]
    assert listed["has_more"] is False

    content = await mesh.client.get(f"/v1/videos/{job['id']}/content")
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    frames = mp4_frames(content.content)
    assert len(frames) == 9 and frames[0].shape == (32, 48, 3)

    deleted = await mesh.client.delete(f"/v1/videos/{job['id']}")
    assert deleted.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert (await mesh.client.get(f"/v1/videos/{job['id']}")).status_code == 404
    assert (await mesh.client.get(f"/v1/videos/{job['id']}/content")).status_code == 404
    assert not list(mesh.store.glob("*/*.mp4"))


async def test_content_before_completion_is_a_400_and_unknown_ids_are_404(
    mesh: VideoMesh,
) -> None:
    mesh.dit.step_seconds = 0.2
    job = (await mesh.client.post("/v1/videos", **multipart(FORM))).json()
    early = await mesh.client.get(f"/v1/videos/{job['id']}/content")
    assert early.status_code == 400 and early.json()["error"]["code"] == "video_not_ready"
    for method, path in (("GET", "/v1/videos/nope"), ("DELETE", "/v1/videos/nope"),
                         ("GET", "/v1/videos/nope/content")):
        response = await mesh.client.request(method, path)
        assert response.status_code == 404 and response.json()["error"]["param"] == "id"
    await mesh.client.delete(f"/v1/videos/{job['id']}")


async def test_a_job_deleted_mid_run_stops_within_a_step_and_is_never_decoded(
    mesh: VideoMesh,
) -> None:
    mesh.dit.step_seconds = 0.1
    job = (await mesh.client.post("/v1/videos", **multipart(
        {**FORM, "num_inference_steps": "20"}))).json()
    running = await wait_for(mesh.client, job["id"], "in_progress", progress_over=0)
    steps_at_delete = mesh.dit.steps_done[job["id"]]
    response = await mesh.client.delete(f"/v1/videos/{job['id']}")
    assert response.status_code == 200 and response.json()["deleted"] is True
    assert job["id"] in mesh.dit.aborted
    assert mesh.dit.aborted[job["id"]] <= steps_at_delete + 1  # within one step
    assert running["progress"] < 100 and job["id"] not in mesh.vae.decoded
    assert (await mesh.client.get(f"/v1/videos/{job['id']}")).status_code == 404
    await asyncio.sleep(0.3)
    assert job["id"] not in mesh.vae.decoded and not list(mesh.store.glob("anonymous/*"))


async def test_a_queued_job_that_is_deleted_never_starts(mesh: VideoMesh) -> None:
    mesh.dit.step_seconds = 0.1
    form = {**FORM, "num_inference_steps": "10"}
    jobs = [(await mesh.client.post("/v1/videos", **multipart(form))).json() for _ in range(3)]
    queued = jobs[2]  # the gateway runs two jobs at once: the third waits
    assert (await mesh.client.get(f"/v1/videos/{queued['id']}")).json()["status"] == "queued"
    assert (await mesh.client.delete(f"/v1/videos/{queued['id']}")).status_code == 200
    for job in jobs[:2]:
        await mesh.client.delete(f"/v1/videos/{job['id']}")
    await asyncio.sleep(0.2)
    assert queued["id"] not in [start.request_id for start in mesh.dit.starts]


async def test_cancel_by_id_stops_a_job_and_keeps_it_as_cancelled(mesh: VideoMesh) -> None:
    mesh.dit.step_seconds = 0.1
    job = (await mesh.client.post("/v1/videos", **multipart(
        {**FORM, "num_inference_steps": "20"}))).json()
    await wait_for(mesh.client, job["id"], "in_progress", progress_over=0)
    cancel = await mesh.client.post(f"/v1/requests/{job['id']}/cancel")
    assert cancel.status_code == 200, cancel.text
    assert cancel.json()["state"] == "REQUEST_STATE_ABORTED" and cancel.json()["stage"] == "dit"
    ended = await wait_for(mesh.client, job["id"], "failed")  # OpenAI has no `cancelled`
    assert ended["error"]["code"] == "cancelled" and job["id"] not in mesh.vae.decoded
    native = (await mesh.client.get(f"/v1/videoJobs/{job['id']}")).json()
    assert native["state"] == "VIDEO_JOB_STATE_CANCELLED"


async def test_another_gateway_sharing_the_store_deletes_a_running_job(
    mesh: VideoMesh,
) -> None:
    """Gateway B deletes a job gateway A runs: A stops it at its next step (B's marker, and
    B's cancel fanned out to the stages), and the VAE never decodes it."""
    mesh.dit.step_seconds = 0.1
    job = (await mesh.client.post("/v1/videos", **multipart(
        {**FORM, "num_inference_steps": "20"}))).json()
    await wait_for(mesh.client, job["id"], "in_progress", progress_over=0)
    async with open_gateway(mesh.recipes) as other:
        transport = httpx.ASGITransport(app=build_rest_app(other))
        async with httpx.AsyncClient(transport=transport, base_url="http://b") as b:
            seen = await b.get(f"/v1/videos/{job['id']}")
            assert seen.json()["status"] == "in_progress"
            steps_at_delete = mesh.dit.steps_done[job["id"]]
            assert (await b.delete(f"/v1/videos/{job['id']}")).status_code == 200
            assert (await b.get(f"/v1/videos/{job['id']}")).status_code == 404
    for _ in range(100):
        if job["id"] in mesh.dit.aborted:
            break
        await asyncio.sleep(0.02)
    assert mesh.dit.aborted[job["id"]] <= steps_at_delete + 2
    assert (await mesh.client.get(f"/v1/videos/{job['id']}")).status_code == 404
    await asyncio.sleep(0.3)
    assert job["id"] not in mesh.vae.decoded


async def test_a_job_left_running_by_a_stopped_gateway_reads_back_as_failed(
    stages: tuple[dict[str, Any], dict[str, str]], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    servicers, address = stages
    servicers["dit"].step_seconds = 0.2
    monkeypatch.setenv(STORE_ENV, str(tmp_path))
    recipes = video_recipes(address)
    async with open_gateway(recipes) as first:
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_rest_app(first)),
                                   base_url="http://a")
        job = (await client.post("/v1/videos", **multipart(
            {**FORM, "num_inference_steps": "20"}))).json()
        await wait_for(client, job["id"], "in_progress")
        await client.aclose()
    async with open_gateway(recipes) as second:  # the gateway restarted
        app = build_rest_app(second)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://b") as client:
            lost = (await client.get(f"/v1/videos/{job['id']}")).json()
    assert lost["status"] == "failed" and "gateway" in lost["error"]["message"]
    assert job["id"] not in servicers["vae"].decoded


async def test_owners_see_only_their_own_jobs(mesh: VideoMesh) -> None:
    app = build_rest_app(mesh.core, ApiKeys.of(["key-one", "key-two"]))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as client:
        one, two = ({"authorization": f"Bearer {key}"} for key in ("key-one", "key-two"))
        job = (await client.post("/v1/videos", headers=one, **multipart(FORM))).json()
        await wait_for_owner(client, job["id"], one)
        assert (await client.get(f"/v1/videos/{job['id']}", headers=two)).status_code == 404
        assert (await client.get("/v1/videos", headers=two)).json()["data"] == []
        assert (await client.delete(f"/v1/videos/{job['id']}", headers=two)).status_code == 404
        assert (await client.get(f"/v1/videos/{job['id']}", headers=one)).status_code == 200


async def wait_for_owner(client: httpx.AsyncClient, job_id: str,
                         headers: dict[str, str]) -> None:
    for _ in range(200):
        if (await client.get(f"/v1/videos/{job_id}", headers=headers)).json()[
                "status"] == "completed":
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"job {job_id} did not complete")


async def test_listing_pages_newest_first(mesh: VideoMesh) -> None:
    ids = []
    for seed in range(3):
        job = (await mesh.client.post("/v1/videos", **multipart({**FORM, "seed": str(seed)})))
        ids.append(job.json()["id"])
        await wait_for(mesh.client, ids[-1], "completed")
    first = (await mesh.client.get("/v1/videos", params={"limit": 2})).json()
    assert [v["id"] for v in first["data"]] == ids[:0:-1] and first["has_more"] is True
    rest = (await mesh.client.get("/v1/videos", params={"after": first["last_id"]})).json()
    assert [v["id"] for v in rest["data"]] == ids[:1] and rest["has_more"] is False
    oldest = (await mesh.client.get("/v1/videos", params={"order": "asc", "limit": 1})).json()
    assert oldest["first_id"] == ids[0]
    for query, param in (({"limit": 0}, "limit"), ({"after": "nope"}, "after"),
                         ({"order": "up"}, "order"), ({"colour": "red"}, "colour")):
        response = await mesh.client.get("/v1/videos", params=query)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


# -- native REST and gRPC ------------------------------------------------------------------------

async def test_the_native_routes_create_watch_and_download_a_job(mesh: VideoMesh) -> None:
    body = {"prompt": "a circle", "width": 48, "height": 32, "num_frames": 9,
            "num_inference_steps": 3, "request_id": "my-job-1"}
    created = await mesh.client.post("/v1/videoJobs", json=body)
    assert created.status_code == 200, created.text
    assert created.json()["id"] == "my-job-1"
    assert created.json()["state"] in ("VIDEO_JOB_STATE_QUEUED", "VIDEO_JOB_STATE_RUNNING")
    watched = await mesh.client.get("/v1/videoJobs/my-job-1:watch")
    states = [json.loads(line)["state"] for line in watched.text.splitlines()]
    assert states[-1] == "VIDEO_JOB_STATE_SUCCEEDED"
    progress = [json.loads(line)["progress"] for line in watched.text.splitlines()]
    assert progress == sorted(progress) and progress[-1] == 1.0
    download = await mesh.client.get("/v1/videoJobs/my-job-1:download")
    data = b"".join(base64.b64decode(json.loads(line)["data"])
                    for line in download.text.splitlines())
    assert len(mp4_frames(data)) == 9
    again = await mesh.client.post("/v1/videoJobs", json=body)
    assert again.status_code == 409 and again.json()["error"]["param"] == "id"
    listed = (await mesh.client.get("/v1/videoJobs", params={"page_size": 1})).json()
    assert [j["id"] for j in listed["jobs"]] == ["my-job-1"] and listed["next_page_token"] == ""
    deleted = await mesh.client.delete("/v1/videoJobs/my-job-1")
    assert deleted.json()["state"] == "VIDEO_JOB_STATE_SUCCEEDED"  # as it ended
    assert (await mesh.client.get("/v1/videoJobs/my-job-1")).status_code == 404


async def test_a_watched_job_shows_its_middle_frame_previews(mesh: VideoMesh) -> None:
    """`preview` on the native JSON body (and preview_every on the OpenAI form): the DiT is
    asked for them and :watch lines carry the latest as PNG, its step and size."""
    mesh.dit.step_seconds = 0.05  # the watch sees the steps go by
    body = {"prompt": "a circle", "width": 48, "height": 32, "num_frames": 9,
            "num_inference_steps": 3, "request_id": "previewed", "preview": {"every": 1}}
    created = await mesh.client.post("/v1/videoJobs", json=body)
    assert created.status_code == 200, created.text
    assert "preview" not in created.json()  # only a watch carries them
    watched = await mesh.client.get("/v1/videoJobs/previewed:watch")
    lines = [json.loads(line) for line in watched.text.splitlines()]
    assert lines[-1]["state"] == "VIDEO_JOB_STATE_SUCCEEDED"
    previews = [line["preview"] for line in lines if "preview" in line]
    steps = [p["step_index"] for p in previews]
    assert steps and steps == sorted(steps) and steps[-1] == 3, steps
    picture = Image.open(io.BytesIO(base64.b64decode(previews[-1]["png"])))
    assert picture.size == (6, 4) and picture.getpixel((0, 0)) == (120, 120, 120)
    assert (previews[-1]["width"], previews[-1]["height"]) == (6, 4)
    start = mesh.dit.starts[-1]
    assert (start.preview.every, start.preview.size) == (1, 16)  # the DiT's default size
    form = await mesh.client.post("/v1/videos", **multipart(
        {**FORM, "preview_every": "2", "preview_size": "8"}))
    assert form.status_code == 200, form.text
    await wait_for(mesh.client, form.json()["id"], "completed")
    assert (mesh.dit.starts[-1].preview.every, mesh.dit.starts[-1].preview.size) == (2, 8)
    too_big = await mesh.client.post("/v1/videoJobs", json={**body, "request_id": "big",
                                                            "preview": {"every": 1,
                                                                        "size": 33}})
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "preview"


async def test_the_native_create_answers_with_the_jobs_id(mesh: VideoMesh) -> None:
    """As POST /v1/videos: the response's x-request-id is the job's id (what to get, watch or
    cancel it by): the body's request_id, else the client's own x-request-id, else a new id."""
    body = {"prompt": "a circle", "width": 48, "height": 32, "num_frames": 9,
            "num_inference_steps": 2}
    new = await mesh.client.post("/v1/videoJobs", json=body)
    assert new.status_code == 200, new.text
    assert new.json()["id"].startswith("video_")
    assert new.headers["x-request-id"] == new.json()["id"]
    mine = await mesh.client.post("/v1/videoJobs", json=body,
                                  headers={"x-request-id": "my-header-job"})
    assert mine.status_code == 200, mine.text
    assert mine.json()["id"] == "my-header-job" == mine.headers["x-request-id"]
    named = await mesh.client.post("/v1/videoJobs", json={**body, "request_id": "my-body-job"},
                                   headers={"x-request-id": "my-other-id"})
    assert named.status_code == 200, named.text
    assert named.json()["id"] == "my-body-job" == named.headers["x-request-id"]
    got = await mesh.client.get("/v1/videoJobs/my-header-job")
    assert got.status_code == 200 and got.json()["id"] == "my-header-job"


async def test_the_grpc_api_runs_video_jobs(mesh: VideoMesh) -> None:
    async with gateway_stub(mesh.core) as stub:
        job = await stub.CreateVideo(gateway_service_pb2.CreateVideoRequest(
            prompt="a circle", width=48, height=32, num_frames=9, num_inference_steps=2,
            input_reference=png()))
        assert job.model == "i2v" and job.num_frames == 9
        states = [j.state async for j in stub.WatchVideo(
            gateway_service_pb2.WatchVideoRequest(id=job.id))]
        assert states[-1] == gateway_service_pb2.VIDEO_JOB_STATE_SUCCEEDED
        data = b"".join([c.data async for c in stub.DownloadVideo(
            gateway_service_pb2.DownloadVideoRequest(id=job.id))])
        assert len(mp4_frames(data)) == 9
        listed = await stub.ListVideos(gateway_service_pb2.ListVideosRequest())
        assert [j.id for j in listed.jobs] == [job.id]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CreateVideo(gateway_service_pb2.CreateVideoRequest(
                prompt="x", num_frames=6))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await stub.GetVideo(gateway_service_pb2.GetVideoRequest(id="nope"))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        await stub.DeleteVideo(gateway_service_pb2.DeleteVideoRequest(id=job.id))
