"""GET /v1/realtime?model=<chat recipe>: OpenAI's Realtime protocol over a WebSocket.

The handshake is authenticated when API keys are on, by the `Authorization: Bearer` header or
the `openai-insecure-api-key.<key>` subprotocol browsers send (a WebSocket from a page cannot
set headers); without a valid key it is refused before it is accepted (HTTP 403). An accepted
session is then admitted like every request (it holds an admission slot for its life) and
counted against `max_sessions` (default: the sessions the recipe's Transcriber holds at once);
over either limit it gets an `error` event and is closed with 1013 (try again later). A session
silent for `idle_timeout_s` while no answer plays is closed. A socket that closes mid-answer
stops every stage call of the session. The limits are the operator's (`RealtimeLimits`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

from starlette.websockets import WebSocket

from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.errors import GatewayError, Unauthenticated
from stagemesh.gateway.realtime.answer import Send
from stagemesh.gateway.realtime.protocol import RealtimeError, RealtimeLimits, parse_client_event
from stagemesh.gateway.realtime.session import RealtimeSession
from stagemesh.gateway.recipes import Recipe, Task
from stagemesh.gateway.wire.admission import Admission
from stagemesh.gateway.wire.auth import AUTHORIZATION, ApiKeys
from stagemesh.gateway.wire.requests import JsonObject

log = logging.getLogger(__name__)

#: The subprotocol that carries a browser's key, and the one a browser asks to speak.
KEY_SUBPROTOCOL = "openai-insecure-api-key."
REALTIME_SUBPROTOCOL = "realtime"
#: WebSocket close codes (RFC 6455): policy violation, try again later.
CLOSE_POLICY, CLOSE_TRY_LATER, CLOSE_NORMAL = 1008, 1013, 1000


def _authorization(websocket: WebSocket) -> str | None:
    """The handshake's Authorization header, else the key of its key subprotocol."""
    header = websocket.headers.get(AUTHORIZATION)
    if header:
        return header
    for offered in websocket.scope.get("subprotocols", []):
        if offered.startswith(KEY_SUBPROTOCOL):
            return f"Bearer {offered.removeprefix(KEY_SUBPROTOCOL)}"
    return None


class RealtimeRoutes:
    """The realtime route, bound to the gateway core, its keys and its admission."""

    def __init__(self, core: GatewayCore, keys: ApiKeys, admission: Admission,
                 limits: RealtimeLimits | None = None) -> None:
        self.core, self.keys, self.admission = core, keys, admission
        self.limits = RealtimeLimits() if limits is None else limits
        self.sessions = 0  # open now

    async def realtime(self, websocket: WebSocket) -> None:
        try:
            owner = self.keys.owner(_authorization(websocket))
        except Unauthenticated:
            await websocket.close(code=CLOSE_POLICY)  # before accept: the handshake gets 403
            return
        offered = websocket.scope.get("subprotocols", [])
        await websocket.accept(
            subprotocol=REALTIME_SUBPROTOCOL if REALTIME_SUBPROTOCOL in offered else None)
        try:
            recipe = self.core.mesh.recipe(websocket.query_params.get("model", ""), Task.CHAT)
            listener = self.core.mesh.recipe(recipe.listen, Task.SPEECH_TO_TEXT)
            limit = self.limits.max_sessions or (await self.core.catalog.read(
                self.core.catalog.transcriber, listener)).max_sessions
            if self.sessions >= limit:
                raise RealtimeError(f"{limit} realtime sessions are open, the limit; try again "
                                    "later", None, "session_limit_reached")
            self.admission.check()
        except (GatewayError, RealtimeError) as error:
            refusal = error if isinstance(error, RealtimeError) else RealtimeError(
                error.message, error.field_name, error.code.name.lower())
            await websocket.send_text(json.dumps(refusal.event()))
            await websocket.close(code=CLOSE_POLICY if refusal.param else CLOSE_TRY_LATER)
            return
        with self.admission.slot():
            self.sessions += 1
            try:
                await self._serve(websocket, recipe, owner)
            finally:
                self.sessions -= 1

    async def _serve(self, websocket: WebSocket, recipe: Recipe, owner: str) -> None:
        lock = asyncio.Lock()
        gone = False

        async def send(event: JsonObject, unless: Callable[[], bool] | None) -> bool:
            """One event at a time; none once `unless()` holds or the socket is gone."""
            nonlocal gone
            async with lock:
                if gone or (unless is not None and unless()):
                    return False
                try:
                    await websocket.send_text(json.dumps(event))
                except Exception:  # closed under us: the receive loop ends the session
                    gone = True
                    return False
                return True

        session = RealtimeSession(self.core, recipe, owner, send,
                                  self.limits.max_buffer_seconds)
        try:
            await session.open()
            await self._receive(websocket, session, send)
        finally:
            await session.close()

    async def _receive(self, websocket: WebSocket, session: RealtimeSession,
                       send: Send) -> None:
        while True:
            try:
                message = await asyncio.wait_for(websocket.receive(),
                                                 self.limits.idle_timeout_s)
            except TimeoutError:
                if session.busy:
                    continue
                await send(RealtimeError(f"no event for {self.limits.idle_timeout_s:g} s: the "
                                         "session is closed", None, "session_idle_timeout"
                                         ).event(), None)
                await websocket.close(code=CLOSE_NORMAL)
                return
            if message["type"] == "websocket.disconnect":
                return
            event_id = None
            try:
                text = message.get("text")
                if text is None:
                    raise RealtimeError("events are JSON text frames", None, "invalid_json")
                parsed = parse_client_event(text, session.config)
                event_id = parsed.event_id
                await session.handle(parsed.event)
            except RealtimeError as error:
                error.event_id = error.event_id or event_id
                await send(error.event(), None)
            except GatewayError as error:
                await send(RealtimeError(error.message, error.field_name,
                                         error.code.name.lower(), event_id).event(), None)
