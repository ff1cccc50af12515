"""serve_stage_stream, the bidi handler every stage servicer delegates to, driven directly: a
real StepEngine over a fake "echo" adapter, a fake ServicerContext, client messages from a
queue. The Talker's messages carry it (their oneofs have every event kind). No model, no
gRPC server."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Never, TypeVar, cast

import grpc
import pytest
from google.rpc import status_pb2
from prometheus_client import CollectorRegistry

from stagemesh.shared.engine.adapter import (
    EngineRequest,
    InvalidInputError,
    StepBudget,
    StepOutput,
)
from stagemesh.shared.engine.engine import StepEngine
from stagemesh.shared.engine.events import Aborted
from stagemesh.shared.engine.metrics import EngineMetrics
from stagemesh.shared.engine.request import AbortReason
from stagemesh.shared.errors import read_details
from stagemesh.shared.limits import MAX_STAGE_REQUEST_ID_CHARS
from stagemesh.shared.proto.v1 import common_pb2, tokenizer_service_pb2
from stagemesh.shared.proto.v1 import talker_service_pb2 as pb
from stagemesh.shared.stage_stream import StageWire, serve_stage_stream
from stagemesh.shared.tensors import array_from_proto, is_set

pytestmark = pytest.mark.timeout(10)

WAIT = 3.0  # seconds any single wait may take before the test fails instead of hanging

T = TypeVar("T")


# -- the fake stage -----------------------------------------------------------------------------


@dataclass(frozen=True)
class EchoInput:
    steps: int  # steps to run, when not streamed
    streamed: bool  # one step per streamed chunk; a final chunk ends the request
    fail: str = ""  # "field": prepare refuses the voice; "crash": prepare raises


#: A streamed chunk: (value, final). Its partial output is the value.
EchoChunk = tuple[int, bool]


@dataclass
class EchoState:
    payload: EchoInput
    steps: int = 0
    pending: list[EchoChunk] = field(default_factory=list)


class EchoAdapter:
    stage = "echo"

    def __init__(self) -> None:
        self.released: list[str] = []
        self.release_seen = threading.Event()
        self._ids: dict[int, str] = {}

    def check_inputs(self, payload: EchoInput) -> None:
        if not payload.streamed and payload.steps < 1:
            raise InvalidInputError("max_new_frames", "max_new_frames must be >= 1")

    def prepare(self, request: EngineRequest[EchoInput]) -> EchoState:
        if request.payload.fail == "field":
            raise InvalidInputError("voice", "unknown voice 'nobody'")
        if request.payload.fail == "crash":
            raise RuntimeError("the model is on fire")
        state = EchoState(request.payload)
        self._ids[id(state)] = request.request_id
        return state

    def add_input(self, state: EchoState, payload: EchoChunk) -> None:
        state.pending.append(payload)

    def step(self, states: Sequence[EchoState]) -> list[StepOutput[int]]:
        return [self._advance(state) for state in states]

    @staticmethod
    def _advance(state: EchoState) -> StepOutput[int]:
        if not state.payload.streamed:
            state.steps += 1
            return StepOutput(state.steps, finished=state.steps >= state.payload.steps)
        if not state.pending:
            return StepOutput(state.steps, waiting_for_input=True)
        value, final = state.pending.pop(0)
        state.steps += 1
        return StepOutput(state.steps, partial=value, finished=final,
                          waiting_for_input=not final and not state.pending)

    def finish(self, state: EchoState) -> int:
        return state.steps

    def release(self, state: EchoState) -> None:
        self.released.append(self._ids.pop(id(state)))
        self.release_seen.set()

    def batch_key(self, state: EchoState) -> str:
        return "echo"


def _request(message: pb.GenerateFramesRequest, deadline: float | None) -> EngineRequest[EchoInput]:
    start = message.start
    if is_set(start.reference_codes):
        array_from_proto(start.reference_codes)  # a malformed tensor raises TensorDecodeError
    streamed = start.voice == "stream"
    steps = start.sampling.max_new_frames
    return EngineRequest(
        request_id=start.request_id, deadline=deadline,
        budget=StepBudget(total_steps=None if streamed else max(steps, 1)),
        payload=EchoInput(steps=steps, streamed=streamed, fail=start.language))


def _input(message: pb.GenerateFramesRequest) -> EchoChunk:
    if not message.input.text.isdigit():
        raise InvalidInputError("text", f"not a number: {message.input.text!r}")
    return int(message.input.text), message.input.final


def _partial(value: int) -> pb.GenerateFramesResponse:
    return pb.GenerateFramesResponse(frames=pb.CodecFrames(first_frame_index=value))


WIRE: StageWire[pb.GenerateFramesRequest, pb.GenerateFramesResponse, EchoInput, EchoChunk, int,
                int] = StageWire(
    response_cls=pb.GenerateFramesResponse, make_request=_request,
    encode_result=lambda steps: pb.GenerateFramesResult(total_frames=steps),
    encode_partial=_partial, make_input=_input)

EchoEngine = StepEngine[EchoInput, EchoChunk, EchoState, int, int]
Context = grpc.aio.ServicerContext[pb.GenerateFramesRequest, pb.GenerateFramesResponse]


# -- the fake RPC -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RpcStatus:
    """What a client reads from a failed call: code, message, ErrorInfo reason, bad field."""

    code: grpc.StatusCode
    message: str
    reason: str
    field_name: str | None


class RpcAborted(Exception):
    def __init__(self, status: RpcStatus) -> None:
        super().__init__(status)
        self.status = status


class FakeContext:
    """The ServicerContext methods the handler uses."""

    def __init__(self, time_remaining: float | None = None) -> None:
        self._time_remaining = time_remaining

    def time_remaining(self) -> float | None:
        return self._time_remaining

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    async def abort_with_status(self, status: grpc.Status) -> Never:
        raise RpcAborted(_read_status(status))


def _read_status(status: grpc.Status) -> RpcStatus:
    details = dict(status.trailing_metadata)["grpc-status-details-bin"]
    reason, field_name = read_details(status_pb2.Status.FromString(details))
    return RpcStatus(status.code, status.details, reason, field_name)


class Client:
    """The client side of the stream: messages go out in order until `close`."""

    def __init__(self, *messages: pb.GenerateFramesRequest) -> None:
        self._queue: asyncio.Queue[pb.GenerateFramesRequest | None] = asyncio.Queue()
        for message in messages:
            self.send(message)

    def send(self, message: pb.GenerateFramesRequest) -> None:
        self._queue.put_nowait(message)

    def send_input(self, text: str, final: bool = False) -> None:
        self.send(pb.GenerateFramesRequest(input=pb.GenerateFramesInput(text=text, final=final)))

    def close(self) -> None:
        self._queue.put_nowait(None)

    async def messages(self) -> AsyncIterator[pb.GenerateFramesRequest]:
        while (message := await self._queue.get()) is not None:
            yield message


def start(request_id: str = "r1", *, steps: int = 0, voice: str = "", fail: str = "",
          codes: common_pb2.Tensor | None = None) -> pb.GenerateFramesRequest:
    return pb.GenerateFramesRequest(start=pb.GenerateFramesStart(
        request_id=request_id, voice=voice, language=fail, reference_codes=codes,
        sampling=pb.SamplingParams(max_new_frames=steps)))


def handle(
    engine: EchoEngine, client: Client, context: FakeContext | None = None
) -> AsyncIterator[pb.GenerateFramesResponse]:
    fake = FakeContext() if context is None else context
    return serve_stage_stream(engine, WIRE, client.messages(), cast(Context, fake))


async def drain(items: AsyncIterator[T]) -> list[T]:
    """Everything left in a stream, within WAIT seconds."""

    async def rest() -> list[T]:
        return [item async for item in items]

    return await asyncio.wait_for(rest(), WAIT)


async def run(
    engine: EchoEngine, client: Client, context: FakeContext | None = None
) -> list[pb.GenerateFramesResponse]:
    return await drain(handle(engine, client, context))


async def failure(
    engine: EchoEngine, client: Client, context: FakeContext | None = None
) -> RpcStatus:
    with pytest.raises(RpcAborted) as caught:
        await run(engine, client, context)
    return caught.value.status


async def take(
    responses: AsyncIterator[pb.GenerateFramesResponse], count: int
) -> list[pb.GenerateFramesResponse]:
    """The next `count` responses of a running stream."""
    return [await asyncio.wait_for(anext(responses), WAIT) for _ in range(count)]


def kinds(responses: list[pb.GenerateFramesResponse]) -> list[str | None]:
    return [response.WhichOneof("event") for response in responses]


async def prepared_stream(
    engine: EchoEngine,
) -> tuple[Client, AsyncIterator[pb.GenerateFramesResponse]]:
    """A streamed request that the engine has prepared and stepped once (input "1")."""
    client = Client(start(voice="stream"))
    client.send_input("1")
    responses = handle(engine, client)
    assert kinds(await take(responses, 1)) == ["queued"]
    while (kind := kinds(await take(responses, 1))[0]) != "frames":
        assert kind == "progress"  # steps that ran before the input arrived
    return client, responses


@pytest.fixture
def adapter() -> EchoAdapter:
    return EchoAdapter()


@pytest.fixture
def engine(adapter: EchoAdapter) -> Iterator[EchoEngine]:
    engine = StepEngine(adapter, max_pending=2,
                        metrics=EngineMetrics("echo", CollectorRegistry()))
    engine.start()
    yield engine
    assert engine.shutdown(abort_running=True, timeout=WAIT)


# -- a stream that works ------------------------------------------------------------------------


async def test_a_request_streams_queued_progress_and_its_result(engine: EchoEngine) -> None:
    responses = await run(engine, Client(start(steps=3)))
    assert kinds(responses) == ["queued", "progress", "progress", "progress", "result"]
    assert [r.progress.step_index for r in responses[1:4]] == [1, 2, 3]
    assert all(r.progress.total_steps == 3 for r in responses[1:4])
    assert responses[-1].result.total_frames == 3


async def test_streamed_input_comes_back_as_partials(
    engine: EchoEngine, adapter: EchoAdapter
) -> None:
    client = Client(start(voice="stream"))
    client.send_input("7")
    client.send_input("9", final=True)
    responses = await run(engine, client)
    # A step that ran before the input arrived reports progress at step 0 and no frames.
    assert [kind for kind in kinds(responses) if kind != "progress"] == [
        "queued", "frames", "frames", "result"]
    assert [r.frames.first_frame_index for r in responses if r.HasField("frames")] == [7, 9]
    progress = [r.progress for r in responses if r.HasField("progress")]
    assert [p.step_index for p in progress if p.step_index] == [1, 2]
    assert all(p.total_steps == 0 for p in progress)  # open-ended work has no total
    assert responses[-1].result.total_frames == 2
    assert adapter.released == ["r1"]


async def test_progress_is_left_out_of_an_rpc_without_a_progress_event(
    engine: EchoEngine,
) -> None:
    def make_request(
        message: tokenizer_service_pb2.EncodePromptRequest, deadline: float | None
    ) -> EngineRequest[EchoInput]:
        steps = len(message.start.prompt)
        return EngineRequest(request_id=message.start.request_id, deadline=deadline,
                             budget=StepBudget(total_steps=steps), payload=EchoInput(steps, False))

    wire: StageWire[tokenizer_service_pb2.EncodePromptRequest,
                    tokenizer_service_pb2.EncodePromptResponse, EchoInput, EchoChunk, int,
                    int] = StageWire(
        response_cls=tokenizer_service_pb2.EncodePromptResponse, make_request=make_request,
        encode_result=lambda steps: tokenizer_service_pb2.EncodePromptResult())
    requests = [tokenizer_service_pb2.EncodePromptRequest(
        start=tokenizer_service_pb2.EncodePromptStart(request_id="t", prompt="abc"))]

    async def client() -> AsyncIterator[tokenizer_service_pb2.EncodePromptRequest]:
        for request in requests:
            yield request

    context = cast(grpc.aio.ServicerContext[tokenizer_service_pb2.EncodePromptRequest,
                                            tokenizer_service_pb2.EncodePromptResponse],
                   FakeContext())
    responses = await drain(serve_stage_stream(engine, wire, client(), context))
    assert [r.WhichOneof("event") for r in responses] == ["queued", "result"]


# -- the start message ---------------------------------------------------------------------------


@pytest.mark.parametrize("messages", [
    [],
    [pb.GenerateFramesRequest(cancel=common_pb2.Cancel(reason="early"))],
    [pb.GenerateFramesRequest(input=pb.GenerateFramesInput(text="1"))],
], ids=["nothing", "cancel-first", "input-first"])
async def test_the_first_message_must_be_start(
    engine: EchoEngine, messages: list[pb.GenerateFramesRequest]
) -> None:
    client = Client(*messages)
    client.close()
    status = await failure(engine, client)
    assert (status.code, status.reason, status.field_name) == (
        grpc.StatusCode.INVALID_ARGUMENT, "MISSING_START", "start")


@pytest.mark.parametrize("request_id", ["", "x" * (MAX_STAGE_REQUEST_ID_CHARS + 1)])
async def test_a_bad_request_id_is_refused(engine: EchoEngine, request_id: str) -> None:
    status = await failure(engine, Client(start(request_id, steps=1)))
    assert (status.code, status.reason, status.field_name) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "request_id")
    assert str(MAX_STAGE_REQUEST_ID_CHARS) in status.message


async def test_the_longest_request_id_is_accepted(engine: EchoEngine) -> None:
    responses = await run(engine, Client(start("x" * MAX_STAGE_REQUEST_ID_CHARS, steps=1)))
    assert kinds(responses)[-1] == "result"


async def test_a_start_the_adapter_refuses_names_its_field(
    engine: EchoEngine, adapter: EchoAdapter
) -> None:
    status = await failure(engine, Client(start(steps=0)))
    assert (status.code, status.reason, status.field_name, status.message) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "max_new_frames",
        "max_new_frames must be >= 1")
    assert adapter.released == []  # refused before the engine took it


async def test_an_undecodable_tensor_in_the_start_is_refused(engine: EchoEngine) -> None:
    bad = common_pb2.Tensor(dtype=common_pb2.DTYPE_FLOAT32, shape=[2], data=b"\x00" * 3)
    status = await failure(engine, Client(start(steps=1, codes=bad)))
    assert (status.code, status.reason, status.field_name) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "start")
    assert "needs 8" in status.message


async def test_a_full_engine_answers_resource_exhausted(engine: EchoEngine) -> None:
    streams = [engine.submit(_request(start(rid, voice="stream"), None)) for rid in ("a", "b")]
    status = await failure(engine, Client(start("c", steps=1)))
    assert (status.code, status.reason, status.field_name) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_FULL", None)
    assert "limit 2" in status.message
    for rid, stream in zip(("a", "b"), streams, strict=True):
        engine.abort(rid)
        assert isinstance((await drain(stream))[-1], Aborted)


# -- the messages after start --------------------------------------------------------------------


async def test_bad_streamed_input_ends_the_stream_and_the_request(
    engine: EchoEngine, adapter: EchoAdapter
) -> None:
    client, responses = await prepared_stream(engine)
    client.send_input("not a number")
    with pytest.raises(RpcAborted) as caught:
        await take(responses, 1)
    status = caught.value.status
    assert (status.code, status.reason, status.field_name) == (
        grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT", "text")
    assert "not a number" in status.message
    assert adapter.released == ["r1"]


async def test_a_cancel_message_ends_the_stream_with_aborted(
    engine: EchoEngine, adapter: EchoAdapter
) -> None:
    client, responses = await prepared_stream(engine)
    client.send(pb.GenerateFramesRequest(cancel=common_pb2.Cancel(reason="user")))
    rest = await drain(responses)
    assert kinds(rest) == ["aborted"]
    aborted = rest[0].aborted
    assert aborted.step_index == 1
    assert aborted.reason == common_pb2.ABORT_REASON_CANCELLED
    assert aborted.abort_latency_seconds > 0
    assert adapter.released == ["r1"]


# -- how the stream ends -------------------------------------------------------------------------


async def test_a_passed_deadline_is_deadline_exceeded(
    engine: EchoEngine, adapter: EchoAdapter
) -> None:
    context = FakeContext(time_remaining=0.2)  # the request waits for input that never comes
    status = await failure(engine, Client(start(voice="stream")), context)
    assert (status.code, status.reason, status.field_name) == (
        grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED", None)
    assert adapter.released == ["r1"]


@pytest.mark.parametrize(("fail", "code", "field_name", "message"), [
    ("field", grpc.StatusCode.INVALID_ARGUMENT, "voice", "unknown voice 'nobody'"),
    ("crash", grpc.StatusCode.INTERNAL, None, "the model is on fire"),
])
async def test_a_failed_request_maps_to_its_status(
    engine: EchoEngine, fail: str, code: grpc.StatusCode, field_name: str | None, message: str
) -> None:
    status = await failure(engine, Client(start(steps=2, fail=fail)))
    assert status == RpcStatus(code, message, "STAGE_FAILED", field_name)


async def test_a_client_that_goes_away_aborts_the_engine_request(
    engine: EchoEngine, adapter: EchoAdapter
) -> None:
    aborts: list[tuple[str, AbortReason]] = []
    abort = engine.abort

    def record_abort(request_id: str, reason: AbortReason = AbortReason.CANCELLED) -> None:
        aborts.append((request_id, reason))
        abort(request_id, reason)

    engine.abort = record_abort  # type: ignore[method-assign]  # a spy on the real abort
    _, responses = await prepared_stream(engine)

    reading = asyncio.Event()

    async def rpc() -> None:  # what gRPC runs; it cancels this task when the client leaves
        reading.set()  # from here the task runs on until it waits for the next event
        async for _ in responses:
            pass

    task = asyncio.create_task(rpc())
    await asyncio.wait_for(reading.wait(), WAIT)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    assert aborts == [("r1", AbortReason.RPC_CANCELLED)]
    assert await asyncio.to_thread(adapter.release_seen.wait, WAIT)
    assert adapter.released == ["r1"]
