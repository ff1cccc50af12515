"""The stage launcher's protocol, both ends: one JSON object per SOCK_SEQPACKET packet (never
pickle), at most one file descriptor riding along (see `stagemesh.launcher`)."""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: Largest request (a whole environment) or reply, in bytes.
MAX_MESSAGE_BYTES = 1 << 20


class Refused(Exception):
    """A request the launcher does not run (bad, or no safe fork); `request_id` when it could
    read one."""

    def __init__(self, message: str, request_id: int | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True)
class LaunchRequest:
    """Fork a child that runs `stagemesh ARGV` in environment `env`."""

    id: int
    argv: list[str]
    env: dict[str, str]

    def encode(self) -> bytes:
        return json.dumps({"id": self.id, "argv": self.argv, "env": self.env}).encode()

    @classmethod
    def decode(cls, data: bytes) -> LaunchRequest:
        try:
            message = json.loads(data)
        except ValueError as error:  # UnicodeDecodeError too
            raise Refused(f"a request is one JSON object: {error}") from None
        if not isinstance(message, dict):
            raise Refused("a request is one JSON object")
        ident = message.get("id")
        if not isinstance(ident, int) or isinstance(ident, bool):
            raise Refused("'id' must be an integer")
        argv, env = message.get("argv"), message.get("env")
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise Refused("'argv' must be a non-empty list of strings", ident)
        if not (isinstance(env, dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise Refused("'env' must map strings to strings", ident)
        return cls(ident, argv, env)


def send(sock: socket.socket, message: Mapping[str, object], fds: Sequence[int] = ()) -> None:
    socket.send_fds(sock, [json.dumps(message).encode()], list(fds))
