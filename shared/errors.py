"""One place that turns failures into rich gRPC errors (AIP-193), and reads them back.

Every error carries a google.rpc.Status with an ErrorInfo (fixed domain, UPPER_SNAKE reason,
dynamic values in metadata) and, for bad input, a BadRequest naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Never, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "stagemesh.v1"

RequestT = TypeVar("RequestT")
ResponseT = TypeVar("ResponseT")


@dataclass(frozen=True)
class StageError:
    """A gRPC failure as the gateway needs it: code, message and the bad field, if any."""

    code: grpc.StatusCode
    message: str
    reason: str = ""
    field_name: str | None = None


def build_status(
    code: grpc.StatusCode,
    message: str,
    *,
    reason: str,
    field_name: str | None = None,
    metadata: dict[str, str] | None = None,
) -> grpc.Status:
    """A grpc.Status with ErrorInfo (+ BadRequest when a field is named)."""
    metadata = dict(metadata or {})
    details = [error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata)]
    if field_name is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field_name,
                                                                description=message)
        details.append(error_details_pb2.BadRequest(field_violations=[violation]))
    packed = []
    for detail in details:
        item = any_pb2.Any()
        item.Pack(detail)
        packed.append(item)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=packed)
    return rpc_status.to_status(status)


async def abort_with(
    context: grpc.aio.ServicerContext[RequestT, ResponseT],
    code: grpc.StatusCode,
    message: str,
    *,
    reason: str,
    field_name: str | None = None,
) -> Never:
    """End the RPC with a rich status (never returns)."""
    await context.abort_with_status(build_status(code, message, reason=reason,
                                                 field_name=field_name))


def parse_rpc_error(error: grpc.RpcError) -> StageError:
    """Read code, message, ErrorInfo reason and BadRequest field back out of a failed call."""
    if not isinstance(error, grpc.aio.AioRpcError | grpc.Call):  # not from a call: no status
        return StageError(code=grpc.StatusCode.UNKNOWN, message=str(error))
    code, message = error.code(), error.details()
    # from_call is typed for grpc.Call but reads only code(), details() and
    # trailing_metadata(), which an AioRpcError has as well.
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    reason, field_name = read_details(status)
    return StageError(code=code, message=message or "", reason=reason, field_name=field_name)


def read_details(status: status_pb2.Status | None) -> tuple[str, str | None]:
    """The ErrorInfo reason ("" if none) and the first BadRequest field of a rich status."""
    reason, field_name = "", None
    for detail in status.details if status else []:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            if bad.field_violations:
                field_name = bad.field_violations[0].field
    return reason, field_name
