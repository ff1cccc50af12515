"""Gateway errors, the one table from gRPC codes to HTTP statuses, and the one REST error body.

Every REST error (OpenAI routes, native routes, SSE error events, NDJSON error lines) has
OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, where `param` names the bad
field (or is null) and `code` is the lower-case AIP-193 reason (`invalid_argument`,
`stage_unavailable`, ...).
"""

from __future__ import annotations

from typing import TypedDict

import grpc

from stagemesh.shared.errors import StageError

#: gRPC status -> HTTP status for every error the gateway returns over REST.
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

#: OpenAI's error `type` for each HTTP status (anything else is a "server_error").
OPENAI_ERROR_TYPE: dict[int, str] = {
    400: "invalid_request_error", 401: "invalid_request_error", 403: "permission_error",
    413: "invalid_request_error",
    404: "invalid_request_error", 409: "invalid_request_error",
    429: "rate_limit_error", 499: "cancelled", 503: "service_unavailable", 504: "timeout",
}


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)


class ErrorDetail(TypedDict):
    message: str
    type: str
    param: str | None
    code: str


class ErrorBody(TypedDict):
    """The JSON body of every REST error."""

    error: ErrorDetail


class GatewayError(Exception):
    """An error answered to the client as gRPC `code` (REST: the mapped HTTP status)."""

    def __init__(self, code: grpc.StatusCode, message: str, field_name: str | None = None,
                 reason: str = "", retry_after: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field_name = field_name
        self.reason = reason or code.name
        #: Seconds a client should wait before retrying (429s: REST Retry-After, gRPC
        #: retry-after trailing metadata); None = estimated where the answer is sent.
        self.retry_after = retry_after

    @classmethod
    def from_stage(cls, error: StageError, message: str | None = None) -> GatewayError:
        """A stage's own error, passed on with its code, field and reason."""
        return cls(error.code, error.message if message is None else message, error.field_name,
                   reason=error.reason)

    @property
    def http_status(self) -> int:
        return http_status(self.code)

    def body(self) -> ErrorBody:
        """OpenAI's error body; `param` names the bad field."""
        return {"error": {"message": self.message,
                          "type": OPENAI_ERROR_TYPE.get(self.http_status, "server_error"),
                          "param": self.field_name, "code": self.reason.lower()}}


class InvalidRequest(GatewayError):
    """Bad input, named by field."""

    def __init__(self, field_name: str | None, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message, field_name,
                         reason="INVALID_ARGUMENT")


class Unauthenticated(GatewayError):
    """No API key, or not one of the gateway's (REST 401 with WWW-Authenticate: Bearer)."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.UNAUTHENTICATED, message, reason="INVALID_API_KEY")


class PermissionDenied(GatewayError):
    """A valid key that may not do this (an admin route without an admin key): 403."""

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.PERMISSION_DENIED, message, reason="ADMIN_KEY_REQUIRED")


class BodyTooLarge(GatewayError):
    """A request body over the cap: REST 413 (gRPC has no such status: the public port's
    message limit refuses it as RESOURCE_EXHAUSTED before the servicer runs)."""

    def __init__(self, limit: int) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT,
                         f"request body larger than {limit} bytes", "body",
                         reason="BODY_TOO_LARGE")

    @property
    def http_status(self) -> int:
        return 413


class Overloaded(GatewayError):
    """The gateway runs as many requests as it admits: 429 with Retry-After."""

    def __init__(self, limit: int, retry_after: int) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"the gateway is running its limit of {limit} requests; retry in "
                         f"{retry_after} s", reason="GATEWAY_BUSY", retry_after=retry_after)


class StageUnavailable(GatewayError):
    """A stage a request needs cannot be reached (or did not answer in time)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message,
                         reason=reason or "STAGE_UNAVAILABLE")
