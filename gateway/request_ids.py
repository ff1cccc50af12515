"""The one rule for a client-chosen request id, on every route (x-request-id header, the
native and gRPC messages' `request_id`, gRPC `x-request-id` metadata).

An id travels to every stage in gRPC metadata and comes back in headers and logs, so it is
short, printable ASCII from a small alphabet. A bad id is a 400 / INVALID_ARGUMENT naming where
it came from, never replaced by another: the client must be able to cancel by its own id.
"""

from __future__ import annotations

from stagemesh.gateway.errors import InvalidRequest
from stagemesh.shared.limits import MAX_REQUEST_ID_CHARS, REQUEST_ID_PATTERN


def check_request_id(value: str, field_name: str) -> str:
    """`value` if it is a valid id or empty ("not given"); InvalidRequest naming
    `field_name` otherwise."""
    if not value:
        return value
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(field_name, f"{field_name} is longer than {MAX_REQUEST_ID_CHARS} "
                             "characters")
    # Checked after the length, so the match is short and linear.
    if not REQUEST_ID_PATTERN.fullmatch(value):
        raise InvalidRequest(field_name, f"{field_name} may hold only ASCII letters, digits "
                             "and . _ : - (no spaces, control or non-ASCII characters)")
    return value
