"""End to end: the default mesh (`stagemesh serve`) edits images with its `tiny-shapes-edit`
recipe, through the unmodified openai SDK; an edit cancelled by id mid-denoise stops at the DiT
and the VAE never decodes it (read off the stages' own /metrics)."""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WaitUntil = Callable[..., None]
RECIPE = "tiny-shapes-edit"


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (30, 160, 60)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_the_openai_sdk_edits_an_image_on_the_default_mesh(served: Any) -> None:
    client = openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    result = client.images.edit(model=RECIPE, image=("green.png", png(40, 30), "image/png"),
                                prompt="make it red", n=2, size="64x64",
                                extra_body={"seed": 7, "num_inference_steps": 2})
    assert result.data is not None and len(result.data) == 2
    for image in result.data:
        assert image.b64_json is not None
        with Image.open(io.BytesIO(base64.b64decode(image.b64_json))) as opened:
            assert opened.size == (64, 64)


def test_an_edit_cancelled_by_id_stops_at_the_dit_and_is_never_decoded(
    served: Any, wait_until: WaitUntil,
) -> None:
    def metric(stage: str, name: str, **labels: str) -> float:
        return float(served.metric(stage, name, recipe=RECIPE, **labels))

    steps = metric("dit", "stagemesh_steps_total")
    aborted = metric("dit", "stagemesh_requests_finished_total", status="aborted")
    decoded = metric("vae", "stagemesh_requests_finished_total", status="completed")
    answers: list[httpx.Response] = []
    edit = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{served.http_url}/v1/images/edits", timeout=120,
        headers={"x-request-id": "e2e-edit-cancel"},
        data={"model": RECIPE, "prompt": "make it red", "size": "32x32",
              "num_inference_steps": "200", "seed": "1"},
        files={"image": ("green.png", png(32, 32), "image/png")})))
    edit.start()
    wait_until(lambda: metric("dit", "stagemesh_steps_total") >= steps + 2, timeout=60,
               what="the DiT denoising the edit")
    cancel = httpx.post(f"{served.http_url}/v1/requests/e2e-edit-cancel/cancel", timeout=30)
    edit.join(timeout=60)
    assert cancel.status_code == 200 and cancel.json()["stage"] == "dit", cancel.text
    assert answers and answers[0].status_code == 499
    wait_until(lambda: metric("dit", "stagemesh_requests_finished_total",
                              status="aborted") == aborted + 1, what="the DiT's abort")
    assert metric("vae", "stagemesh_requests_finished_total", status="completed") == decoded
