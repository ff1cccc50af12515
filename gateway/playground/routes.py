"""The playground page: one HTML page and its ES modules, served by the gateway at `/` and
`/playground`, shipped as package data (static/).

The page and its assets are open (no API key: a browser cannot send one for a page load); every
API call the page makes carries the key the user typed. Everything it serves carries one strict
Content-Security-Policy: scripts and styles only from the gateway itself (no inline code), images
also from data: (step previews) and blob: URLs, media only from blob: URLs (audio and video are
fetched with the key, then played from memory), and no framing.
"""

from __future__ import annotations

from importlib import resources
from importlib.resources.abc import Traversable

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

#: The exact policy of the page and its assets (issue 26; a test checks it byte for byte).
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "media-src 'self' blob:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'")
#: Where the page is served.
PAGE_PATHS = ("/", "/playground")
#: Where its assets are served (a file name follows).
ASSET_PREFIX = "/playground/static/"
#: The asset types the page has; a file of another type is never served.
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
PAGE_FILE = "index.html"
HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff",
           "referrer-policy": "no-referrer", "cache-control": "no-cache"}


def is_playground_path(path: str) -> bool:
    """Is `path` the page or one of its assets (open to callers without a key)?"""
    return path in PAGE_PATHS or path.startswith(ASSET_PREFIX)


def _static() -> Traversable:
    return resources.files(__package__).joinpath("static")


def _suffix(name: str) -> str:
    return name[name.rfind("."):] if "." in name else ""


def _assets() -> dict[str, Traversable]:
    """name -> file of every servable asset: a fixed table, so no request path reaches the
    file system (no traversal, no directory listing)."""
    return {entry.name: entry for entry in _static().iterdir()
            if entry.is_file() and _suffix(entry.name) in MEDIA_TYPES}


def _file_response(file: Traversable) -> Response:
    return Response(file.read_bytes(), media_type=MEDIA_TYPES[_suffix(file.name)],
                    headers=HEADERS)


def playground_routes() -> list[Route]:
    """The routes of the page (GET `/`, `/playground`) and of its assets."""
    assets = _assets()

    async def page(request: Request) -> Response:
        return _file_response(assets[PAGE_FILE])

    async def asset(request: Request) -> Response:
        file = assets.get(request.path_params["name"])
        if file is None:
            return PlainTextResponse("not found", status_code=404, headers=HEADERS)
        return _file_response(file)

    return [*(Route(path, page, methods=["GET"]) for path in PAGE_PATHS),
            Route(ASSET_PREFIX + "{name}", asset, methods=["GET"])]
