"""End to end: the video routes of `stagemesh serve` (the default mesh's video recipes: the
trained tiny-shapes-video, the seeded wan-i2v-tiny), driven by plain httpx as curl would: the
README's example judged from its frames, the sync MP4, a job from create to download, an
image-to-video job from a data URL, and a job deleted mid-run that the VAE never decodes (the
stages' own /metrics say so). Every job made here is deleted (the store is the user's cache)."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from stagemesh.models.tiny_shapes_video.data import parse_clip_caption
from stagemesh.models.tiny_shapes_video.judge import FRAME_FRACTION, judge_measurement, measure_clip
from tests.video_forms import form, frames_of

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

T2V, I2V = "tiny-shapes-video", "wan-i2v-tiny"
#: README.md's video example, field for field (`curl -F`): no model, so the default recipe.
README_VIDEO = {"prompt": "a red circle moving right", "size": "32x32", "num_frames": "9",
                "seed": "1"}


def status(served: Any, job_id: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{served.http_url}/v1/videos/{job_id}", timeout=30).json()
    return body


def test_the_readme_video_shows_what_it_asks_for(served: Any) -> None:
    """The README's curl: 9 frames of 32x32 that the judge reads as a red circle, on white, in
    >= 90% of frames, moving right: the clip is judged right as a whole."""
    response = httpx.post(f"{served.http_url}/v1/videos/sync", timeout=120,
                          **form(**README_VIDEO))
    assert response.status_code == 200, response.text
    assert response.headers["x-model"] == T2V, "the README's example runs the trained model"
    clip = np.stack(frames_of(response.content))
    assert clip.shape == (9, 32, 32, 3)
    wanted, seen = parse_clip_caption(README_VIDEO["prompt"]), measure_clip(clip)
    verdict = judge_measurement(wanted, seen)
    assert verdict["background"] and verdict["motion"], seen
    assert sum(c == wanted.colour for c in seen.colours) >= FRAME_FRACTION * len(clip), seen
    assert sum(s == wanted.shape for s in seen.shapes) >= FRAME_FRACTION * len(clip), seen
    assert verdict["correct"], seen


def test_sync_answers_an_mp4_of_the_requested_frames_and_size(served: Any) -> None:
    response = httpx.post(f"{served.http_url}/v1/videos/sync", timeout=120, **form(
        prompt="a red circle moving right", model=T2V, size="48x32", num_frames="21",
        seed="5"))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "video/mp4"
    assert response.headers["x-request-id"].startswith("video_sync-")
    assert response.headers["x-model"] == T2V
    assert float(response.headers["x-inference-time-s"]) >= 0
    frames = frames_of(response.content)
    assert len(frames) == 21 and all(f.shape == (32, 48, 3) for f in frames)


def test_an_image_to_video_job_runs_from_create_to_download(
    served: Any, wait_until: Callable[..., None],
) -> None:
    buffer = io.BytesIO()
    Image.new("RGB", (48, 32), (240, 20, 20)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    created = httpx.post(f"{served.http_url}/v1/videos", timeout=60, **form(
        prompt="the red square slides", size="32x32", seconds="1", fps="8",
        image_reference=json.dumps({"image_url": url})))
    assert created.status_code == 200, created.text
    job = created.json()
    assert job["object"] == "video" and job["model"] == I2V
    wait_until(lambda: status(served, job["id"])["status"] not in ("queued", "in_progress"),
               timeout=120, what="the job's end")
    assert status(served, job["id"])["status"] == "completed"
    content = httpx.get(f"{served.http_url}/v1/videos/{job['id']}/content", timeout=60)
    assert content.status_code == 200 and content.headers["content-type"] == "video/mp4"
    frames = frames_of(content.content)
    assert len(frames) == 9 and frames[0].shape == (32, 32, 3)  # 1 s x 8 fps -> 4k+1 = 9
    listed = httpx.get(f"{served.http_url}/v1/videos", timeout=30).json()
    assert job["id"] in [video["id"] for video in listed["data"]]
    deleted = httpx.delete(f"{served.http_url}/v1/videos/{job['id']}", timeout=30)
    assert deleted.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert httpx.get(f"{served.http_url}/v1/videos/{job['id']}", timeout=30).status_code == 404


def test_a_job_deleted_mid_run_stops_and_the_vae_never_decodes_it(
    served: Any, wait_until: Callable[..., None],
) -> None:
    def vae_finished() -> float:
        samples: dict[str, float] = served.metrics("vae", T2V)
        return sum(value for key, value in samples.items()
                   if key.startswith("stagemesh_requests_finished_total{"))

    decoded_before = vae_finished()
    aborted_before = served.metric("dit", "stagemesh_requests_finished_total", recipe=T2V,
                                   status="aborted")
    job = httpx.post(f"{served.http_url}/v1/videos", timeout=60, **form(
        prompt="a long video", model=T2V, size="128x128", num_frames="33",
        num_inference_steps="100")).json()
    wait_until(lambda: status(served, job["id"])["progress"] >= 1, timeout=120,
               what="the job's first steps")
    deleted = httpx.delete(f"{served.http_url}/v1/videos/{job['id']}", timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert httpx.get(f"{served.http_url}/v1/videos/{job['id']}", timeout=30).status_code == 404
    wait_until(lambda: served.metric("dit", "stagemesh_requests_finished_total", recipe=T2V,
                                     status="aborted") > aborted_before,
               what="the DiT's abort")
    assert vae_finished() == decoded_before


@pytest.mark.parametrize(("fields", "param"), [
    ({"model": T2V, "num_frames": "8"}, "num_frames"),
    ({"model": T2V, "num_frames": "5"}, "num_frames"),  # 2 latent frames: not a whole token
    ({"model": T2V, "guidance_scale_2": "2"}, "guidance_scale_2"),
    ({"model": I2V}, "input_reference"),
    ({"image_reference": json.dumps({"image_url": "https://example.com/a.png"})},
     "image_reference"),
])
def test_the_seeds_error_cases_are_400s_naming_the_field(
    served: Any, fields: dict[str, str], param: str,
) -> None:
    response = httpx.post(f"{served.http_url}/v1/videos/sync", timeout=30,
                          **form(prompt="a circle", **fields))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
