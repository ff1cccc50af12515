"""The playground's routes and their place in the gateway's key check, without a mesh."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from stagemesh.gateway.playground.routes import CSP, is_playground_path, playground_routes
from stagemesh.gateway.wire.auth import ApiKeyMiddleware, ApiKeys

KEY = "sk-unit"


async def _api(request: Request) -> PlainTextResponse:
    return PlainTextResponse("api")


def _client() -> TestClient:
    app = Starlette(routes=[*playground_routes(), Route("/v1/models", _api),
                            Route("/playgroundx", _api)])
    app.add_middleware(ApiKeyMiddleware, keys=ApiKeys.of([KEY]))
    return TestClient(app)


def test_the_page_and_its_assets_are_open_under_keys_and_the_api_is_not() -> None:
    client = _client()
    for path in ("/", "/playground", "/playground/static/app.js",
                 "/playground/static/style.css", "/playground/static/icon.svg"):
        answer = client.get(path)
        assert answer.status_code == 200, path
        assert answer.headers["content-security-policy"] == CSP
        assert answer.headers["x-content-type-options"] == "nosniff"
    assert client.get("/v1/models").status_code == 401
    assert client.get("/playgroundx").status_code == 401  # a prefix of a path is not the page
    assert client.get("/v1/models", headers={"authorization": f"Bearer {KEY}"}).text == "api"


def test_only_the_shipped_assets_are_served() -> None:
    client = _client()
    assert client.get("/playground/static/nope.js").status_code == 404
    assert client.get("/playground/static/__init__.py").status_code != 200
    assert client.get("/playground/static/%2e%2e%2f__init__.py").status_code == 404
    assert client.post("/").status_code == 405
    assert client.get("/playground/static/app.js").headers["content-type"].startswith(
        "text/javascript")


def test_the_page_names_only_assets_it_serves_and_loads_no_inline_code() -> None:
    page = _client().get("/").text
    assert "<style" not in page and "style=" not in page and "<script>" not in page
    assert "http://" not in page and "https://" not in page  # nothing from elsewhere
    assert is_playground_path("/") and is_playground_path("/playground/static/x.js")
    assert not is_playground_path("/v1/playground") and not is_playground_path("/playgrounds")
