"""How engine events become stage responses, for the events not every stage RPC carries:
`Preempted` goes out only where the response message has a `preempted` event (the DiT's)."""

from __future__ import annotations

from typing import Never

from google.protobuf.message import Message

from stagemesh.shared.engine.adapter import EngineRequest
from stagemesh.shared.engine.events import Preempted, Progress
from stagemesh.shared.proto.v1 import common_pb2, dit_service_pb2, talker_service_pb2
from stagemesh.shared.stage_stream import StageWire, _to_response


def _unused(*args: object) -> Never:
    raise AssertionError("not called when mapping events")


def _unused_request(message: object, deadline: float | None) -> EngineRequest[None]:
    _unused(message, deadline)


DIT_WIRE: StageWire[dit_service_pb2.DenoiseRequest, dit_service_pb2.DenoiseResponse, None,
                    Never, Never, None] = StageWire(
    response_cls=dit_service_pb2.DenoiseResponse, make_request=_unused_request,
    encode_result=_unused)
TALKER_WIRE: StageWire[talker_service_pb2.GenerateFramesRequest,
                       talker_service_pb2.GenerateFramesResponse, None, Never, Never,
                       None] = StageWire(
    response_cls=talker_service_pb2.GenerateFramesResponse, make_request=_unused_request,
    encode_result=_unused)


def _event_of(response: Message | None) -> str | None:
    assert isinstance(response, dit_service_pb2.DenoiseResponse)
    return response.WhichOneof("event")


def test_preempted_maps_to_the_preempted_event_where_the_response_has_one() -> None:
    response = _to_response(DIT_WIRE, Preempted(step_index=7), None)
    assert _event_of(response) == "preempted"
    assert response == dit_service_pb2.DenoiseResponse(
        preempted=common_pb2.Preempted(step_index=7))


def test_preempted_is_left_out_where_the_response_has_no_preempted_event() -> None:
    assert "preempted" not in talker_service_pb2.GenerateFramesResponse.DESCRIPTOR.fields_by_name
    assert _to_response(TALKER_WIRE, Preempted(step_index=7), None) is None


def test_progress_after_a_preemption_still_maps_to_progress() -> None:
    response = _to_response(DIT_WIRE, Progress(8, 20, 0.1, 2.0), None)
    assert _event_of(response) == "progress"
