"""End to end: the shipped trained default draws what it is asked (pixel statistics, not bytes)."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def draw(served, prompt: str, seed: int = 0) -> np.ndarray:
    client = openai.OpenAI(base_url=f"{served.http_url}/v1", api_key="unused", max_retries=0)
    result = client.images.generate(model="tiny-shapes", prompt=prompt, size="32x32",
                                    extra_body={"seed": seed, "num_inference_steps": 16})
    image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))
    return np.asarray(image.convert("RGB")).astype(np.int32)


def border(image: np.ndarray) -> np.ndarray:
    return np.concatenate([image[0], image[-1], image[:, 0], image[:, -1]])


@pytest.mark.parametrize("seed", [0, 1])
def test_a_red_circle_on_the_left_is_red_left_of_centre_on_light(served, seed: int) -> None:
    image = draw(served, "a red circle on the left", seed)
    red, green, blue = image[..., 0], image[..., 1], image[..., 2]
    mask = (red > 150) & (green < 110) & (blue < 110)
    assert mask.sum() >= 20, "expected a red region"
    columns = np.nonzero(mask)[1]
    assert columns.mean() < 16 - 3, "the red region must lie left of centre"
    assert np.median(border(image), axis=0).min() > 180, "expected a light background"


@pytest.mark.parametrize("seed", [0, 1])
def test_a_blue_square_on_black_is_blue_on_dark(served, seed: int) -> None:
    image = draw(served, "a blue square on a black background", seed)
    red, green, blue = image[..., 0], image[..., 1], image[..., 2]
    mask = (blue > 140) & (red < 110) & (green < 110)
    assert mask.sum() >= 20, "expected a blue region"
    assert np.median(border(image), axis=0).max() < 70, "expected a dark background"


def test_a_blue_square_at_the_top_sits_in_the_upper_half(served) -> None:
    image = draw(served, "a blue square at the top on a black background")
    mask = (image[..., 2] > 140) & (image[..., 0] < 110) & (image[..., 1] < 110)
    assert mask.sum() >= 20
    assert np.nonzero(mask)[0].mean() < 16 - 3


def test_the_default_mesh_streams_previews_of_the_picture_forming(served) -> None:
    """tiny-shapes as shipped makes previews (its DiT decodes them with its own small VAE):
    every 4th step's progress carries one, and the last looks like the image."""
    with httpx.stream("POST", f"{served.http_url}/v1/images/generations", timeout=60, json={
            "model": "tiny-shapes", "prompt": "a red circle on the left", "size": "32x32",
            "num_inference_steps": 16, "seed": 0, "stream": True,
            "preview": {"every": 4, "size": 32}}) as response:
        assert response.status_code == 200
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    previews = {e["step"]: e["preview"] for e in events
                if e["type"] == "progress" and e.get("stage") == "dit" and "preview" in e}
    assert sorted(previews) == [4, 8, 12, 16]
    header = "data:image/png;base64,"
    assert all(url.startswith(header) for url in previews.values())
    last = np.asarray(Image.open(io.BytesIO(base64.b64decode(
        previews[16][len(header):]))).convert("RGB")).astype(np.int32)
    assert last.shape == (32, 32, 3)
    mask = (last[..., 0] > 150) & (last[..., 1] < 110) & (last[..., 2] < 110)
    assert mask.sum() >= 20 and np.nonzero(mask)[1].mean() < 16 - 3  # red, on the left
