"""MP4 muxing: frames written chunk by chunk decode back (PyAV) to the same count, size and
rate, near the pixels written; and the form reader that takes the video requests is bounded."""

from __future__ import annotations

import importlib.util
import io
from collections.abc import AsyncIterator
from fractions import Fraction
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stagemesh.gateway.errors import GatewayError
from stagemesh.gateway.videos.mux import EncoderMissing, Mp4Writer, check_encoder, h264_encoder
from stagemesh.gateway.wire.forms import read_form
from stagemesh.gateway.wire.requests import MAX_BODY_BYTES, error_response

find_spec = importlib.util.find_spec


def frames(count: int, height: int, width: int, start: int = 0) -> np.ndarray:
    """Flat frames whose grey level says their index (H.264 keeps flat colours closely)."""
    levels = (np.arange(start, start + count) * 20 + 20).astype(np.uint8)
    return np.broadcast_to(levels[:, None, None, None], (count, height, width, 3)).copy()


def decoded(source: Path | io.BytesIO) -> tuple[list[np.ndarray], Fraction | None, str]:
    with av.open(str(source) if isinstance(source, Path) else source, "r") as container:
        stream = container.streams.video[0]
        pictures = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        return pictures, stream.average_rate, stream.codec_context.name


@pytest.mark.parametrize("to_file", [True, False])
def test_chunks_mux_into_an_mp4_of_every_frame(tmp_path: Path, to_file: bool) -> None:
    target: Path | io.BytesIO = tmp_path / "v.mp4" if to_file else io.BytesIO()
    writer = Mp4Writer(target, width=48, height=32, fps=8)
    writer.write(frames(4, 32, 48))
    writer.write(frames(5, 32, 48, start=4))
    assert writer.close() == 9
    if isinstance(target, io.BytesIO):
        target.seek(0)
    pictures, rate, codec = decoded(target)
    assert codec == "h264" and rate == 8
    assert len(pictures) == 9 and all(p.shape == (32, 48, 3) for p in pictures)
    levels = [int(np.median(p)) for p in pictures]
    assert all(abs(level - (i * 20 + 20)) <= 3 for i, level in enumerate(levels)), levels


def test_frames_of_the_wrong_shape_or_an_odd_size_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="even"):
        Mp4Writer(tmp_path / "odd.mp4", width=33, height=32, fps=8)
    writer = Mp4Writer(tmp_path / "v.mp4", width=32, height=32, fps=8)
    with pytest.raises(ValueError, match=r"\[n, 32, 32, 3\]"):
        writer.write(frames(1, 16, 32))
    writer.abort()


def test_the_encoder_is_h264() -> None:
    name, _ = h264_encoder()
    assert name in ("libx264", "libopenh264")


def test_without_pyav_a_video_is_a_503_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """PyAV is the optional `video-gpl` extra: without it the refusal says what to install."""
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "av" else find_spec(name, *args))
    with pytest.raises(EncoderMissing) as missing:
        check_encoder()
    assert missing.value.http_status == 503 and "stagemesh[video-gpl]" in missing.value.message
    assert missing.value.body()["error"]["code"] == "video_encoder_missing"


# -- read_form ---------------------------------------------------------------------------------

async def echo(request: Request) -> Response:
    try:
        form = await read_form(request, large_fields={"big": 100_000}, max_file_bytes=1000,
                               max_files=2)
        form.refuse_unknown({"prompt", "big", "image", "n"})
        return JSONResponse({"prompt": form.text("prompt"),
                             "files": [f.filename for f in form.file_list("image")],
                             "sizes": [len(f.data) for f in form.file_list("image")]})
    except GatewayError as error:
        return error_response(error)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    app = Starlette(routes=[Route("/form", echo, methods=["POST"])])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as client:
        yield client


async def test_a_form_reads_its_fields_and_files(client: httpx.AsyncClient) -> None:
    response = await client.post("/form", data={"prompt": "a cat"}, files=[
        ("image", ("a.png", b"x" * 10, "image/png")),
        ("image[]", ("b.png", b"y" * 20, "image/png"))])
    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": "a cat", "files": ["a.png", "b.png"], "sizes": [10, 20]}


@pytest.mark.parametrize(("data", "files", "param"), [
    ({"prompt": "x" * 70_000}, None, "prompt"),  # a text field past its limit
    ({"prompt": "x", "colour": "red"}, None, "colour"),
    ({"prompt": "x", "image": "not a file"}, None, "image"),
    ({"prompt": "x"}, [("image", ("a.png", b"x" * 1001, "image/png"))], "image"),
    ({"prompt": "x"}, [("image", ("a.png", b"x", "image/png"))] * 3, "body"),  # file count
])
async def test_form_limits_are_400s_naming_the_field(
    client: httpx.AsyncClient, data: dict[str, str],
    files: list[tuple[str, tuple[str, bytes, str]]] | None, param: str,
) -> None:
    # httpx sends a form without files urlencoded: a text part forces multipart
    parts: list[tuple[str, tuple[str | None, bytes, str]]] = [("n", (None, b"1", "text/plain"))]
    response = await client.post("/form", data=data, files=[*parts, *(files or [])])
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_a_repeated_text_field_is_refused(client: httpx.AsyncClient) -> None:
    response = await client.post("/form", files=[("prompt", (None, b"a")),
                                                 ("prompt", (None, b"b"))])
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


async def test_a_body_past_the_cap_is_a_413(client: httpx.AsyncClient) -> None:
    declared = await client.post("/form", content=b"x", headers={
        "content-type": "multipart/form-data; boundary=b",
        "content-length": str(MAX_BODY_BYTES + 1)})
    assert declared.status_code == 413

    async def body() -> AsyncIterator[bytes]:  # no length: refused as the bytes pass the cap
        yield b"--b\r\ncontent-disposition: form-data; name=\"big\"\r\n\r\n"
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 1):
            yield b"x" * (1 << 20)

    streamed = await client.post("/form", content=body(),
                                 headers={"content-type": "multipart/form-data; boundary=b"})
    assert streamed.status_code == 413
    assert streamed.json()["error"]["param"] == "body"


async def test_a_body_that_is_not_a_multipart_form_names_the_body(
    client: httpx.AsyncClient,
) -> None:
    for headers, content in (({"content-type": "application/json"}, b"{}"),
                             ({"content-type": "multipart/form-data; boundary=b"}, b"garbage")):
        response = await client.post("/form", content=content, headers=headers)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "body"
