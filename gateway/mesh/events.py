"""Turning a pipeline that reports through callbacks into an async stream of typed events."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from stagemesh.shared.proto.v1 import common_pb2

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Part:
    """Which output of a request an event is about: image `index` of n, drawn with `seed`."""

    index: int
    seed: int


@dataclass(frozen=True)
class StageEvent:
    """A stage's queue position, step progress or preemption, as it streamed it; `part` is
    set when the stage call serves one output of several (an image of an n-image request)."""

    stage: str
    event: common_pb2.Queued | common_pb2.Progress | common_pb2.Preempted
    part: Part | None = None


@dataclass(frozen=True)
class Output(Generic[T]):
    """A piece of the request's output (an image, an audio chunk), in order."""

    value: T


@dataclass(frozen=True)
class Done(Generic[R]):
    """The pipeline returned; `result` is its return value."""

    result: R


#: How a pipeline reports: awaited for each event, in order.
Emit = Callable[[StageEvent | Output[T]], Awaitable[None]]


async def stream_pipeline(
    run: Callable[[Emit[T]], Awaitable[R]],
) -> AsyncGenerator[StageEvent | Output[T] | Done[R], None]:
    """Run `run(emit)` as a task and yield what it emits, then Done.

    The pipeline's exceptions propagate to the consumer. If the consumer stops early (client
    gone), the pipeline task is cancelled, which cancels its open stage call.
    """
    queue: asyncio.Queue[StageEvent | Output[T] | None] = asyncio.Queue()

    async def runner() -> R:
        try:
            return await run(queue.put)
        finally:
            queue.put_nowait(None)  # the end marker

    task = asyncio.create_task(runner())
    try:
        while (item := await queue.get()) is not None:
            yield item
        yield Done(await task)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
