"""Turning a pipeline that reports through callbacks into an async stream of events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import Message


@dataclass(frozen=True)
class StageEvent:
    """A non-terminal event of one stage (its response message: queued, progress, partial)."""

    stage: str
    response: Message


@dataclass(frozen=True)
class Output:
    """A piece of the request's output (an image, an audio chunk), in order."""

    value: Any


@dataclass(frozen=True)
class Done:
    """The pipeline returned; `result` is its return value."""

    result: Any


Emit = Callable[[Any], Awaitable[None]]


async def stream_pipeline(
    run: Callable[[Emit], Awaitable[Any]],
) -> AsyncIterator[StageEvent | Output | Done]:
    """Run `run(emit)` as a task and yield what it emits, then Done.

    The pipeline's exceptions propagate to the consumer. If the consumer stops early (client
    gone), the pipeline task is cancelled, which cancels its open stage call.
    """
    queue: asyncio.Queue[Any] = asyncio.Queue()
    finished = object()

    async def runner() -> Any:
        try:
            return await run(queue.put)
        finally:
            queue.put_nowait(finished)

    task = asyncio.create_task(runner())
    try:
        while (item := await queue.get()) is not finished:
            yield item
        yield Done(await task)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
