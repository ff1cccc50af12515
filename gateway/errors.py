"""Gateway errors and the one table that maps gRPC codes to HTTP statuses."""

from __future__ import annotations

import grpc

#: gRPC status -> HTTP status for every error the gateway returns over REST.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}

#: OpenAI's error `type` for each HTTP status family.
OPENAI_ERROR_TYPE = {400: "invalid_request_error", 404: "invalid_request_error",
                     409: "invalid_request_error", 429: "rate_limit_error",
                     499: "cancelled", 503: "service_unavailable", 504: "timeout"}


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)


class GatewayError(Exception):
    """An error answered to the client as gRPC `code` (REST: the mapped HTTP status)."""

    def __init__(self, code: grpc.StatusCode, message: str, field_name: str | None = None,
                 reason: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field_name = field_name
        self.reason = reason or code.name

    def to_openai(self) -> dict[str, object]:
        """OpenAI's error body: {"error": {message, type, param, code}}."""
        status = http_status(self.code)
        return {"error": {"message": self.message,
                          "type": OPENAI_ERROR_TYPE.get(status, "server_error"),
                          "param": self.field_name, "code": self.reason.lower()}}


class InvalidRequest(GatewayError):
    """Bad input, named by field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message, field_name,
                         reason="INVALID_ARGUMENT")
