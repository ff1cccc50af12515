"""The server processes' event loop: asyncio's own by default, uvloop with STAGEMESH_UVLOOP=1."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from stagemesh.shared import eventloop


async def _loop_type() -> type[asyncio.AbstractEventLoop]:
    return type(asyncio.get_running_loop())


@pytest.mark.parametrize(("value", "expected"), [
    (None, asyncio.SelectorEventLoop), ("1", uvloop.Loop), ("0", asyncio.SelectorEventLoop),
    ("false", asyncio.SelectorEventLoop), ("on", uvloop.Loop),
])
def test_stagemesh_uvloop_chooses_the_loop(monkeypatch: pytest.MonkeyPatch, value: str | None,
                                           expected: type[asyncio.AbstractEventLoop]) -> None:
    if value is None:
        monkeypatch.delenv(eventloop.UVLOOP_ENV, raising=False)
    else:
        monkeypatch.setenv(eventloop.UVLOOP_ENV, value)
    assert issubclass(eventloop.run(_loop_type()), expected)


def test_a_value_that_is_not_a_switch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(eventloop.UVLOOP_ENV, "sometimes")
    with pytest.raises(ValueError, match="STAGEMESH_UVLOOP"):
        eventloop.uvloop_wanted()
