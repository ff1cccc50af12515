"""Gateway API keys: who may call the public API, and which requests belong to whom.

Keys come from `STAGEMESH_API_KEYS` (comma-separated) and/or a keys file (one key per line,
`#` starts a comment). With no key configured, authentication is off (every caller is the one
anonymous owner) and the gateway says so at start.

A caller presents `Authorization: Bearer KEY` (REST header, or `authorization` gRPC metadata).
The check hashes the presented key and compares it with the SHA-256 of every configured key
using `hmac.compare_digest`, always over all keys, so neither the position of a matching key
nor a common prefix shows in the timing. `/health` and `/metrics` (REST) and grpc.health and
reflection (gRPC) stay open: probes and scrapers hold no key; so do the playground page and
its assets (a browser loads them without a key; every API call of the page sends one).

Requests and their ids belong to the key that started them: the owner id is a short hash of
the key (never the key itself, which is never logged), and cancel-by-id and id reuse are
scoped to it (see core.py / mesh/calls.py).

Admin keys (`STAGEMESH_ADMIN_KEYS`, the same comma-separated format) are API keys that may also
change what the mesh serves: the ADMIN_PATHS (loading and unloading LoRA adapters). With keys
on, any other key gets 403 there; with no key configured at all, anyone may (as everywhere).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from stagemesh.gateway.errors import PermissionDenied, Unauthenticated
from stagemesh.gateway.playground.routes import is_playground_path
from stagemesh.shared.interception import HandlerInterceptor, HttpMiddleware
from stagemesh.shared.mesh_auth import is_infrastructure

log = logging.getLogger(__name__)

RequestT = TypeVar("RequestT")
ResponseT = TypeVar("ResponseT")

API_KEYS_ENV = "STAGEMESH_API_KEYS"
ADMIN_KEYS_ENV = "STAGEMESH_ADMIN_KEYS"
#: The REST routes that change what the mesh serves: admin keys only (gateway/loras/).
LOAD_LORA_PATH = "/v1/load_lora_adapter"
UNLOAD_LORA_PATH = "/v1/unload_lora_adapter"
ADMIN_PATHS = frozenset({LOAD_LORA_PATH, UNLOAD_LORA_PATH})
AUTHORIZATION = "authorization"
BEARER = "bearer"
#: REST paths any caller may read (probes, Prometheus).
OPEN_PATHS = frozenset({"/health", "/metrics"})
#: The owner of every request when authentication is off.
ANONYMOUS = ""
#: Hex digits of the key's hash that name its owner (64 bits: unique among any real key set).
OWNER_ID_HEX = 16
#: A presented key longer than this is refused unhashed (keys are short random strings).
MAX_KEY_CHARS = 1024


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def owner_id(key: str) -> str:
    """The id requests started with `key` belong to: a short hash, safe to keep and compare
    (a different hash domain from the key check, so it says nothing about the digests)."""
    label = hashlib.sha256(b"stagemesh-owner\0" + key.encode("utf-8", "surrogatepass"))
    return "key-" + label.hexdigest()[:OWNER_ID_HEX]


def env_keys(environ: Mapping[str, str], name: str) -> list[str]:
    """The keys of a comma-separated environment variable (absent: none)."""
    return [key.strip() for key in environ.get(name, "").split(",") if key.strip()]


def parse_keys(lines: Iterable[str]) -> list[str]:
    """Keys from the lines of a keys file: blank lines and `#` comments are skipped."""
    keys = []
    for line in lines:
        key = line.split("#", 1)[0].strip()
        if key:
            keys.append(key)
    return keys


def bearer_token(authorization: str | None) -> str | None:
    """The key of an `Authorization: Bearer KEY` value (scheme case-insensitive), else None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != BEARER or not token or len(token) > MAX_KEY_CHARS:
        return None
    return token


def _matches(presented: bytes, digests: Iterable[bytes]) -> bool:
    """Whether `presented` is one of `digests`, compared with every one whatever matched (no
    early exit: the timing says nothing about which key matched)."""
    matched = False
    for digest in digests:
        matched |= hmac.compare_digest(presented, digest)
    return matched


@dataclass(frozen=True)
class Caller:
    """Who presented a valid key (or anyone, with auth off)."""

    owner: str
    admin: bool


@dataclass(frozen=True)
class ApiKeys:
    """The configured keys (as digests; admin keys among them) and the check of a presented
    one."""

    digests: tuple[bytes, ...] = ()
    admin_digests: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, keys: Iterable[str], admin: Iterable[str] = ()) -> ApiKeys:
        admins = list(dict.fromkeys(admin))
        return cls(tuple(_digest(key) for key in dict.fromkeys([*keys, *admins])),
                   tuple(_digest(key) for key in admins))

    @classmethod
    def load(cls, environ: Mapping[str, str], keys_file: Path | None = None) -> ApiKeys:
        """Keys from STAGEMESH_API_KEYS and `keys_file` together (either may be absent), and
        the admin keys of STAGEMESH_ADMIN_KEYS."""
        keys = env_keys(environ, API_KEYS_ENV)
        if keys_file is not None:
            keys += parse_keys(keys_file.read_text(encoding="utf-8").splitlines())
        return cls.of(keys, env_keys(environ, ADMIN_KEYS_ENV))

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def owner(self, authorization: str | None) -> str:
        """The owner id of a caller presenting `authorization` (ANONYMOUS when auth is off).

        Raises Unauthenticated for a missing or unknown key.
        """
        return self.caller(authorization).owner

    def caller(self, authorization: str | None) -> Caller:
        """The caller presenting `authorization`: its owner id, and whether its key is an
        admin key (everyone is, with auth off). Raises Unauthenticated for a missing or
        unknown key."""
        if not self.enabled:
            return Caller(ANONYMOUS, admin=True)
        token = bearer_token(authorization)
        if token is None:
            raise Unauthenticated("missing API key: send 'Authorization: Bearer YOUR_KEY'")
        presented = _digest(token)
        if not _matches(presented, self.digests):
            raise Unauthenticated("invalid API key")
        return Caller(owner_id(token), _matches(presented, self.admin_digests))

    def log_mode(self, where: str) -> None:
        """Say at start whether the gateway checks keys (never which keys)."""
        if self.enabled:
            log.info("%s: API keys required (%d configured, %d of them admin keys)", where,
                     len(self.digests), len(self.admin_digests))
        else:
            log.warning("%s: authentication is OFF: anyone who can reach the gateway can use "
                        "it; set %s or --api-keys-file to require API keys", where,
                        API_KEYS_ENV)


def header(scope: Scope, name: bytes) -> str | None:
    """An ASGI request header (latin-1, as HTTP carries it), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value).decode("latin-1")
    return None


class ApiKeyMiddleware(HttpMiddleware):
    """REST: 401 (OpenAI's error body, WWW-Authenticate: Bearer) without a valid key, 403 on
    an ADMIN_PATH without an admin key; the caller's owner id goes to
    `scope["state"]["owner"]`."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        super().__init__(app)
        self.keys = keys

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] in OPEN_PATHS or is_playground_path(scope["path"]):
            # the page's own calls carry the key
            await self.app(scope, receive, send)
            return
        try:
            caller = self.keys.caller(header(scope, AUTHORIZATION.encode()))
        except Unauthenticated as error:
            response = JSONResponse(error.body(), status_code=error.http_status,
                                    headers={"www-authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        if scope["path"] in ADMIN_PATHS and not caller.admin:
            denied = PermissionDenied(f"{scope['path']} needs an admin key ({ADMIN_KEYS_ENV})")
            await JSONResponse(denied.body(), status_code=denied.http_status)(scope, receive, send)
            return
        scope.setdefault("state", {})["owner"] = caller.owner
        await self.app(scope, receive, send)


def metadata_value(metadata: Iterable[tuple[str, str | bytes]] | None, name: str
                   ) -> str | None:
    """A text gRPC metadata value (keys are lower case on the wire), or None."""
    for key, value in metadata or ():
        if key == name and isinstance(value, str):
            return value
    return None


class ApiKeyInterceptor(HandlerInterceptor):
    """gRPC: UNAUTHENTICATED without a valid `authorization: Bearer KEY` metadata entry,
    before the request message is read (an unauthenticated message is never parsed).

    The servicer reads the owner again from the call's metadata (`ApiKeys.owner`): an
    interceptor cannot hand a value to the handler.
    """

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    def intercept(self, handler: grpc.RpcMethodHandler[RequestT, ResponseT] | None,
                  handler_call_details: grpc.HandlerCallDetails,
                  ) -> grpc.RpcMethodHandler[RequestT, ResponseT] | None:
        if handler is None or is_infrastructure(handler_call_details.method):
            return handler
        try:
            self.keys.owner(metadata_value(handler_call_details.invocation_metadata,
                                           AUTHORIZATION))
        except Unauthenticated as error:
            return _refusal(handler, error)
        return handler


def _refusal(handler: grpc.RpcMethodHandler[RequestT, ResponseT],
             error: Unauthenticated) -> grpc.RpcMethodHandler[RequestT, ResponseT]:
    """A handler of `handler`'s kind that ends the call with `error`, reading nothing."""

    async def refuse(request: object, context: grpc.aio.ServicerContext[object, object]
                     ) -> None:
        await context.abort(error.code, error.message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)
