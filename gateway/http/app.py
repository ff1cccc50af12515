"""The REST app: every route (routes.py) behind the middleware, and the one place where an
error becomes a response.

A route raises; it never writes an error body itself. A GatewayError before the response
starts is its JSON error body with the mapped HTTP status (errors.py); a client that left
(ClientGone) gets 499. An error after a stream's first byte never reaches these handlers: the
stream ends with its own error event or line (wire/streams.py).
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import WebSocketRoute
from starlette.types import Message, Receive, Scope, Send

from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.errors import GatewayError, InvalidRequest
from stagemesh.gateway.http.metrics import RequestMetricsMiddleware
from stagemesh.gateway.http.routes import rest_routes
from stagemesh.gateway.mesh.calls import new_request_id
from stagemesh.gateway.realtime.protocol import RealtimeLimits
from stagemesh.gateway.realtime.routes import RealtimeRoutes
from stagemesh.gateway.request_ids import check_request_id
from stagemesh.gateway.wire.admission import Admission, AdmissionMiddleware
from stagemesh.gateway.wire.auth import ApiKeyMiddleware, ApiKeys, header
from stagemesh.gateway.wire.requests import (
    CLIENT_GONE_STATUS,
    REQUEST_ID_HEADER,
    ClientGone,
    error_response,
)
from stagemesh.shared.interception import HttpMiddleware
from stagemesh.shared.tracing import TracingMiddleware


async def _gateway_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, GatewayError)
    return error_response(error)


async def _client_gone(request: Request, error: Exception) -> Response:
    return Response(status_code=CLIENT_GONE_STATUS)


#: Every REST error, mapped once.
EXCEPTION_HANDLERS = {GatewayError: _gateway_error, ClientGone: _client_gone}


class RequestIdMiddleware(HttpMiddleware):
    """Every response carries x-request-id: the client's own, or a new one when it sent none.
    An x-request-id the client did send that breaks the rule (request_ids.py) is a 400
    naming `x-request-id`: never replaced, so the client can cancel by its own id."""

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        given = header(scope, REQUEST_ID_HEADER.encode()) or ""
        try:
            request_id = check_request_id(given, REQUEST_ID_HEADER) or new_request_id()
        except InvalidRequest as error:
            await error_response(error)(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        state["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                # a route may name the request itself (a video job's id) when the client
                # gave no id
                final = state.get("request_id", request_id)
                message["headers"] = [*message.get("headers", []),
                                      (REQUEST_ID_HEADER.encode(), str(final).encode())]
            await send(message)

        await self.app(scope, receive, send_with_id)


def build_rest_app(core: GatewayCore, keys: ApiKeys | None = None,
                   admission: Admission | None = None,
                   realtime_limits: RealtimeLimits | None = None) -> Starlette:
    """The REST app over an open core (see routes.py for the routes). Outermost first: the
    request id (every answer carries one), metrics (refusals are counted), API keys, then
    admission (a refused caller takes no slot)."""
    keys = ApiKeys() if keys is None else keys
    admission = Admission(core) if admission is None else admission
    # The realtime route checks keys and admits by itself.
    realtime = RealtimeRoutes(core, keys, admission, realtime_limits)
    app = Starlette(routes=[*rest_routes(core), WebSocketRoute("/v1/realtime", realtime.realtime)],
                    exception_handlers=EXCEPTION_HANDLERS)
    app.add_middleware(AdmissionMiddleware, admission=admission)
    app.add_middleware(ApiKeyMiddleware, keys=keys)
    app.add_middleware(RequestMetricsMiddleware)
    app.add_middleware(TracingMiddleware)  # a server span per request, when traces are on
    app.add_middleware(RequestIdMiddleware)
    return app


