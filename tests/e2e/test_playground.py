"""The playground page in a real browser: Debian's Chromium driven by Playwright (never
Playwright's own browser download), against the e2e session's mesh.

Without Chromium the browser tests skip naming the command that installs it; under CI=true they
fail instead (a CI that silently skipped them would prove nothing). Screenshots go to
test-results/playground/ (git-ignored); tools/playground_pictures.py copies the README's
pictures from there to docs/.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from PIL import Image
from playwright.sync_api import Browser, sync_playwright
from playwright.sync_api import Page as BrowserPage
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from stagemesh.gateway.playground.routes import CSP, playground_routes
from stagemesh.gateway.wire.streams import SSE_DONE, sse_event
from stagemesh.serve import free_port

from .conftest import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REPO_ROOT = Path(__file__).resolve().parents[2]
SHOTS = REPO_ROOT / "test-results" / "playground"
AXE = REPO_ROOT / "node_modules" / "axe-core" / "axe.min.js"
INSTALL_HINT = "apt-get install chromium"
PHONE = {"width": 390, "height": 844}
TABS = ("image", "edit", "speech", "chat", "video")
KEY = "sk-playground-test"
#: Steps of the stand-in run that sends previews.
PREVIEW_STEPS = 4
#: How long a browser-side wait may take (the mesh shares a small machine with the tests).
WAIT_MS = 60_000

WaitUntil = Callable[..., None]


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = f"the playground's browser test needs Chromium: {INSTALL_HINT}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    executable = _chromium()
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=executable,
            # sound starts from a click in real use; headless has no user to make the gesture
            args=["--autoplay-policy=no-user-gesture-required"])
        yield launched
        launched.close()


class Page:
    """One tab of the browser at phone width, with what it logged about its policy."""

    def __init__(self, browser: Browser, base_url: str, *, bypass_csp: bool = False) -> None:
        self.context = browser.new_context(viewport=PHONE, bypass_csp=bypass_csp)
        self.page = self.context.new_page()
        self.csp_violations: list[str] = []
        self.page.on("console", lambda message: self.csp_violations.append(message.text)
                     if "Content Security Policy" in message.text else None)
        self.base_url = base_url

    def open(self) -> BrowserPage:
        self.page.goto(self.base_url + "/", wait_until="load")
        return self.page

    def shot(self, name: str) -> None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


@pytest.fixture
def page(browser: Browser, served) -> Iterator[Page]:
    opened = Page(browser, served.http_url)
    yield opened
    assert opened.csp_violations == [], "the page broke its own Content-Security-Policy"
    opened.context.close()


def _dit_counters(served) -> dict[str, float]:
    def finished(stage: str, status: str) -> float:
        return served.metric(stage, "stagemesh_requests_finished_total", recipe="tiny-shapes",
                             status=status)

    return {"aborted": finished("dit", "aborted"), "completed": finished("dit", "completed"),
            "vae_steps": served.metric("vae", "stagemesh_steps_total", recipe="tiny-shapes"),
            "vae_completed": finished("vae", "completed")}


def test_the_page_and_its_assets_are_served_open_under_the_exact_policy(served) -> None:
    for path in ("/", "/playground"):
        page = httpx.get(served.http_url + path, timeout=10)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.headers["content-security-policy"] == CSP
        assert 'src="/playground/static/app.js"' in page.text
    script = httpx.get(f"{served.http_url}/playground/static/app.js", timeout=10)
    assert script.headers["content-type"].startswith("text/javascript")
    assert script.headers["content-security-policy"] == CSP
    assert httpx.get(f"{served.http_url}/playground/static/nope.js", timeout=10).status_code == 404
    assert CSP == ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' "
                   "data: blob:; media-src 'self' blob:; connect-src 'self'; "
                   "frame-ancestors 'none'; base-uri 'none'")


def test_generate_then_cancel_mid_run_stops_the_dit_before_the_vae(
        page: Page, served, wait_until: WaitUntil) -> None:
    tab = page.open()
    tab.fill("#image-prompt", "a blue square on the right")
    tab.fill("#image-seed", "7")
    tab.click("#image-form button[type=submit]")
    tab.wait_for_selector("#image-run[data-state=done] .images img", timeout=WAIT_MS)
    page.shot("image-done")

    before = _dit_counters(served)
    tab.select_option("#image-size", "256x256")  # long steps: a cancel lands mid-run
    tab.fill("#image-steps", "200")
    tab.click("#image-form button[type=submit]")
    tab.wait_for_function("() => document.querySelector('#image-run progress').value >= 3",
                          timeout=WAIT_MS)
    if tab.is_visible("#image-run img.preview"):  # the DiT sends previews (issue 26 part 1)
        assert tab.get_attribute("#image-run img.preview", "src").startswith(
            "data:image/png;base64,")
    page.shot("image-running")
    tab.click("#image-form button.cancel")
    tab.wait_for_selector("#image-run[data-state=cancelled]", timeout=WAIT_MS)
    page.shot("image-cancelled")

    status = tab.inner_text("#image-run .status")
    reached = re.search(r"in the dit stage at step (\d+) of 200", status)
    assert reached, status
    assert 3 <= int(reached.group(1)) < 200
    assert re.search(r"stopped \d+ ms after the cancel", status), status
    wait_until(lambda: _dit_counters(served)["aborted"] - before["aborted"] >= 1,
               what="the DiT counting the aborted request")
    after = _dit_counters(served)
    assert after["aborted"] - before["aborted"] == 1
    assert after["completed"] == before["completed"]
    assert after["vae_steps"] == before["vae_steps"], "the VAE must not decode a cancelled image"
    assert after["vae_completed"] == before["vae_completed"]


def test_speech_plays_while_it_streams(page: Page) -> None:
    tab = page.open()
    tab.click("#tab-speech")
    tab.fill("#speech-text", "Hello there, how are you today? The page plays this answer while "
             "the stages still speak it. Press Stop whenever you like.")
    tab.click("#speech-form button[type=submit]")
    tab.wait_for_function("() => window.stagemeshAudio.scheduledSeconds >= 1",
                          timeout=WAIT_MS)
    page.shot("speech")
    tab.click("#speech-form button.stop")
    assert tab.inner_text("#speech-status") == "Stopped."


def test_chat_answers(page: Page) -> None:
    tab = page.open()
    tab.click("#tab-chat")
    tab.fill("#chat-text", "What is the capital of France?")
    tab.click("#chat-form button[type=submit]")
    tab.wait_for_selector("#chat-log li.assistant[data-complete]", timeout=WAIT_MS)
    assert "Paris" in tab.inner_text("#chat-log li.assistant")
    assert tab.input_value("#chat-text") == ""  # ready for the next message
    tab.fill("#chat-text", "What is the capital of France?")
    tab.check("#chat-spoken")  # the same question, answered out loud
    tab.click("#chat-form button[type=submit]")
    tab.wait_for_function("() => window.stagemeshAudio.scheduledSeconds >= 1", timeout=WAIT_MS)
    tab.wait_for_selector("#chat-log li.assistant:nth-of-type(4)[data-complete]",
                          timeout=WAIT_MS)
    assert "Paris" in tab.inner_text("#chat-log li.assistant:nth-of-type(4)")
    page.shot("chat")
    assert tab.is_disabled("#chat-mic")
    assert "realtime route" in tab.inner_text("#chat-mic-help")


def _png(colour: tuple[int, int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), colour).save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(colour: tuple[int, int, int]) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(colour)).decode()


@pytest.fixture(scope="module")
def previewing_gateway() -> Iterator[tuple[str, list[dict[str, object]]]]:
    """The page's routes beside a stand-in image route whose SSE progress carries a preview
    each step, as issue 26's DiT previews will (`preview`: a PNG data URL), whether or not the
    mesh's DiT sends them yet; yields its URL and the bodies it was sent."""
    bodies: list[dict[str, object]] = []

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"data": [{"id": "tiny-shapes", "task": "text-to-image"}]})

    async def generations(request: Request) -> StreamingResponse:
        bodies.append(await request.json())

        async def events() -> AsyncIterator[bytes]:
            for step in range(1, PREVIEW_STEPS + 1):
                await asyncio.sleep(0.1)
                yield sse_event({"type": "progress", "stage": "dit", "step": step,
                                 "total_steps": PREVIEW_STEPS, "step_seconds": 0.1,
                                 "preview": _data_url((40 * step, 0, 200))})
            yield sse_event({"type": "image", "b64_json": _data_url((0, 0, 255)).split(",")[1],
                             "index": 0, "seed": 1})
            yield SSE_DONE

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[*playground_routes(), Route("/v1/models", models),
                            Route("/v1/images/generations", generations, methods=["POST"])])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, what="the stand-in gateway listening")
        yield f"http://127.0.0.1:{port}", bodies
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_previews_in_progress_events_show_until_the_image_arrives(
        browser: Browser, previewing_gateway: tuple[str, list[dict[str, object]]]) -> None:
    url, bodies = previewing_gateway
    previewing = Page(browser, url)
    tab = previewing.open()
    tab.click("#image-form button[type=submit]")
    tab.wait_for_selector("#image-run img.preview[alt^='Preview of the image at step ']",
                          timeout=WAIT_MS)
    assert tab.get_attribute("#image-run img.preview", "src").startswith("data:image/png")
    tab.wait_for_selector("#image-run[data-state=done] .images img", timeout=WAIT_MS)
    assert tab.is_hidden("#image-run img.preview")
    assert bodies[0]["preview"] == {"every": 1}  # the page asks for previews every step
    assert previewing.csp_violations == []
    previewing.context.close()


def test_edit_an_upload_and_run_play_and_delete_a_video_job(page: Page) -> None:
    tab = page.open()
    tab.click("#tab-edit")
    tab.set_input_files("#edit-image", files=[{"name": "red.png", "mimeType": "image/png",
                                               "buffer": _png((220, 30, 30))}])
    tab.click("#edit-form button[type=submit]")
    tab.wait_for_selector("#edit-run[data-state=done] .images img", timeout=WAIT_MS)

    tab.click("#tab-video")
    tab.fill("#video-prompt", "a red circle moving right")
    tab.click("#video-form button[type=submit]")
    job = "#video-jobs li:has-text('a red circle moving right')"
    tab.wait_for_selector(f"{job}[data-status=completed]", timeout=WAIT_MS)
    tab.click(f"{job} button:has-text('Play')")
    tab.wait_for_function("() => document.querySelector('#video-player').src.startsWith('blob:')",
                          timeout=WAIT_MS)
    page.shot("video")
    tab.click(f"{job} button:has-text('Delete')")
    tab.wait_for_selector(job, state="detached", timeout=WAIT_MS)


def test_every_tab_fits_a_phone_is_keyboard_usable_and_passes_axe(browser: Browser,
                                                                   served) -> None:
    if not AXE.is_file():
        message = f"axe-core is missing: npm ci (expected {AXE})"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    # bypass_csp only so that axe can be injected; the other tests run under the page's policy
    checked = Page(browser, served.http_url, bypass_csp=True)
    tab = checked.open()
    tab.wait_for_function("() => document.querySelector('#image-model').options.length > 0")
    tab.add_script_tag(path=str(AXE))
    tab.focus("#tab-image")
    for name in TABS:
        assert tab.evaluate("document.activeElement.id") == f"tab-{name}"
        assert tab.is_visible(f"#panel-{name}")
        assert tab.evaluate("document.documentElement.scrollWidth") <= PHONE["width"], name
        result = tab.evaluate("axe.run(document, {resultTypes: ['violations']})")
        critical = [(v["id"], v["help"]) for v in result["violations"]
                    if v["impact"] == "critical"]
        assert critical == [], (name, critical)
        tab.keyboard.press("ArrowRight")  # the tab list moves with the arrow keys
    checked.context.close()


# -- with API keys on ---------------------------------------------------------------------------

KEYED_RECIPES = """recipes:
  - name: tiny-shapes
    task: text-to-image
    model: builtin:tiny-shapes
    stages:
      tokenizer: {{address: "127.0.0.1:{0}"}}
      dit: {{address: "127.0.0.1:{1}"}}
      vae: {{address: "127.0.0.1:{2}"}}
"""


@pytest.fixture(scope="module")
def keyed_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway that requires a key, over stage addresses where nothing listens: what is
    checked is that the page's calls carry the key, not what the stages answer."""
    recipes = tmp_path_factory.mktemp("keyed") / "recipes.yaml"
    recipes.write_text(KEYED_RECIPES.format(free_port(), free_port(), free_port()))
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "stagemesh", "gateway", "--recipes", str(recipes),
         "--http-port", str(port), "--grpc-port", str(free_port())],
        env={**os.environ, "STAGEMESH_API_KEYS": KEY})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 401:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, "no keyed gateway"
            time.sleep(0.2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_with_keys_on_the_page_asks_for_one_and_every_call_carries_it(
        browser: Browser, keyed_gateway: str) -> None:
    keyed = Page(browser, keyed_gateway)
    sent: list[tuple[str, str, str | None]] = []
    keyed.page.on("request", lambda request: sent.append(
        (request.method, request.url.removeprefix(keyed_gateway),
         request.headers.get("authorization"))))
    tab = keyed.open()
    tab.wait_for_selector("#key-form:not([hidden])", timeout=WAIT_MS)
    keyed.shot("key-prompt")
    tab.fill("#key-input", "sk-wrong")
    tab.press("#key-input", "Enter")
    tab.wait_for_selector("#key-error:has-text('That key was refused.')", timeout=WAIT_MS)
    tab.fill("#key-input", KEY)
    tab.press("#key-input", "Enter")
    tab.wait_for_selector("#key-form", state="hidden", timeout=WAIT_MS)
    tab.click("#image-form button[type=submit]")  # no stages there: the page shows the 503
    tab.wait_for_selector("#image-run[data-state=failed]", timeout=WAIT_MS)
    assert "unavailable" in tab.inner_text("#image-run .status")
    tab.click("#tab-video")
    tab.wait_for_load_state("networkidle")

    assert tab.evaluate("sessionStorage.getItem('stagemesh.apiKey')") == KEY
    assert tab.evaluate("localStorage.length") == 0 and tab.evaluate("document.cookie") == ""
    api = [call for call in sent if call[1].startswith("/v1/")]
    # before any key: one probe of the models (answered 401, which shows the prompt)
    assert api[0] == ("GET", "/v1/models", None)
    assert api[1] == ("GET", "/v1/models", "Bearer sk-wrong")
    with_key = api[2:]
    assert {path for _, path, _ in with_key} >= {"/v1/models", "/v1/images/generations",
                                                 "/v1/videos"}
    assert all(auth == f"Bearer {KEY}" for _, _, auth in with_key), with_key
    page_loads = [call for call in sent if not call[1].startswith("/v1/")]
    assert page_loads and all(auth is None for _, _, auth in page_loads)  # open, keyless
    keyed.context.close()
