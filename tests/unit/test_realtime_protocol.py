"""The realtime route's protocol without any stage: events parsed and refused by field name,
the handshake's keys, the session limit reached and released, history bounds and truncation.
(The spoken conversation and barge-in over real stages: tests/e2e/test_serve_realtime.py.)"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from stagemesh.gateway.core import GatewayCore
from stagemesh.gateway.mesh.stages import Mesh, StageCatalog
from stagemesh.gateway.realtime.answer import AssistantItem, SpokenSpan
from stagemesh.gateway.realtime.protocol import (
    MAX_APPEND_CHARS,
    Append,
    RealtimeError,
    RealtimeLimits,
    SessionConfig,
    SessionUpdate,
    parse_client_event,
)
from stagemesh.gateway.realtime.routes import RealtimeRoutes
from stagemesh.gateway.realtime.session import Conversation, Item
from stagemesh.gateway.recipes import Recipe, StageEndpoint, Task
from stagemesh.gateway.wire.admission import Admission
from stagemesh.gateway.wire.auth import ApiKeys

KEY = "sk-realtime-test"


def refusal(event: dict[str, object]) -> RealtimeError:
    with pytest.raises(RealtimeError) as raised:
        parse_client_event(json.dumps(event), SessionConfig())
    return raised.value


def test_audio_formats_other_than_pcm_24k_are_refused_by_field() -> None:
    for fmt in ({"type": "audio/pcmu"}, {"type": "audio/pcm", "rate": 16000}):
        error = refusal({"type": "session.update", "session": {
            "type": "realtime", "audio": {"input": {"format": fmt}}}})
        assert error.param == "session.audio.input.format", error.message
    error = refusal({"type": "session.update", "session": {
        "audio": {"output": {"format": {"type": "audio/pcma"}}}}})
    assert error.param == "session.audio.output.format"


def test_session_update_reads_vad_voice_and_instructions() -> None:
    parsed = parse_client_event(json.dumps({"type": "session.update", "event_id": "e1",
                                            "session": {
        "type": "realtime", "instructions": "Be brief.",
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000},
                            "turn_detection": {"type": "server_vad", "silence_duration_ms": 300,
                                               "interrupt_response": False}},
                  "output": {"voice": "joe"}}}}), SessionConfig())
    assert parsed.event_id == "e1" and isinstance(parsed.event, SessionUpdate)
    config = parsed.event.config
    assert config.instructions == "Be brief." and config.voice == "joe"
    assert config.turn_detection is not None
    assert config.turn_detection.silence_duration_ms == 300
    assert not config.turn_detection.interrupt_response
    off = parse_client_event(json.dumps({"type": "session.update", "session": {
        "audio": {"input": {"turn_detection": None}}}}), config)
    assert isinstance(off.event, SessionUpdate) and off.event.config.turn_detection is None
    assert off.event.config.instructions == "Be brief."  # what is not given is kept
    assert refusal({"type": "session.update", "session": {"audio": {"input": {
        "turn_detection": {"type": "semantic_vad"}}}}}).param == (
        "session.audio.input.turn_detection.type")


def test_appends_are_pcm16_and_bounded() -> None:
    pcm = np.array([0, 1000, -1000, 32767], np.int16)
    parsed = parse_client_event(json.dumps({"type": "input_audio_buffer.append", "audio":
                                            base64.b64encode(pcm.tobytes()).decode()}),
                                SessionConfig())
    assert isinstance(parsed.event, Append)
    assert np.array_equal(parsed.event.pcm, pcm)
    oversized = refusal({"type": "input_audio_buffer.append",
                         "audio": "AAAA" * (MAX_APPEND_CHARS // 4 + 1)})
    assert oversized.param == "audio" and str(MAX_APPEND_CHARS) in oversized.message
    assert refusal({"type": "input_audio_buffer.append", "audio": "not base64!"}).param == "audio"
    assert refusal({"type": "input_audio_buffer.append", "audio": "AA=="}).param == "audio"


def test_unknown_types_and_bad_items_name_the_field() -> None:
    unknown = refusal({"type": "response.explode", "event_id": "e7"})
    assert (unknown.param, unknown.code, unknown.event_id) == ("type", "invalid_event_type",
                                                               "e7")
    assert refusal({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "hi"}, {"type": "input_image"}]}}).param == (
        "item.content[1].type")
    assert refusal({"type": "conversation.item.truncate", "item_id": "x"}).param == (
        "audio_end_ms")
    big = refusal({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text",
                                                        "text": "x" * 300_000}]}})
    assert big.param == "type"  # past the size of any event but an append


def test_history_fits_the_thinker_and_truncation_keeps_what_was_heard() -> None:
    conversation = Conversation()
    for index in range(10):
        conversation.add(Item(f"i{index}", "user" if index % 2 == 0 else "assistant",
                              f"turn {index}"))
    turns = conversation.turns("Be brief.", max_messages=4, max_chars=1000)
    assert [t.content for t in turns] == ["Be brief.", "turn 7", "turn 8", "turn 9"]
    assert [t.content for t in conversation.turns("", 10, 14)] == ["turn 8", "turn 9"]
    answer = AssistantItem("a", [SpokenSpan("One two three four.", 0, 1000),
                                 SpokenSpan("Five six seven eight.", 1000, 2000)])
    answer.truncate(1500)
    assert answer.text == "One two three four. Five six"


@pytest.fixture
def core() -> GatewayCore:
    mesh = Mesh({
        "whisper": Recipe(name="whisper", task=Task.SPEECH_TO_TEXT, model="w",
                          stages={"transcriber": StageEndpoint("transcriber", "127.0.0.1:9")}),
        "chat": Recipe(name="chat", task=Task.CHAT, model="c", listen="whisper",
                       stages={"thinker": StageEndpoint("thinker", "127.0.0.1:9")})})
    return GatewayCore(mesh, StageCatalog(mesh))


@pytest.fixture
def served(core: GatewayCore) -> Iterator[tuple[TestClient, RealtimeRoutes]]:
    routes = RealtimeRoutes(core, ApiKeys.of([KEY]), Admission(None, 8),
                            RealtimeLimits(max_sessions=1))
    app = Starlette(routes=[WebSocketRoute("/v1/realtime", routes.realtime)])
    with TestClient(app) as client:
        yield client, routes


def test_keyless_handshakes_are_refused_before_accept_and_keys_open_sessions(
        served: tuple[TestClient, RealtimeRoutes]) -> None:
    client, _ = served
    with (pytest.raises(WebSocketDisconnect) as refused,
          client.websocket_connect("/v1/realtime?model=chat")):
        pass
    assert refused.value.code == 1008
    with client.websocket_connect("/v1/realtime?model=chat", subprotocols=[
            "realtime", f"openai-insecure-api-key.{KEY}"]) as socket:
        assert socket.accepted_subprotocol == "realtime"
        created = socket.receive_json()
        assert created["type"] == "session.created"
        assert created["session"]["audio"]["input"]["format"] == {"type": "audio/pcm",
                                                                   "rate": 24000}
    with client.websocket_connect("/v1/realtime?model=chat",
                                  headers={"Authorization": f"Bearer {KEY}"}) as socket:
        assert socket.receive_json()["type"] == "session.created"


def test_errors_name_the_field_and_the_session_limit_is_released(
        served: tuple[TestClient, RealtimeRoutes]) -> None:
    client, routes = served
    auth = {"Authorization": f"Bearer {KEY}"}
    with client.websocket_connect("/v1/realtime?model=chat", headers=auth) as socket:
        assert socket.receive_json()["type"] == "session.created"
        assert routes.sessions == 1 and routes.admission.running == 1
        with client.websocket_connect("/v1/realtime?model=chat", headers=auth) as second:
            over = second.receive_json()
            assert over["type"] == "error" and over["error"]["code"] == "session_limit_reached"
        sent = [
            ({"type": "session.update", "session": {"audio": {"input": {"format": {
                "type": "audio/pcmu"}}}}}, "session.audio.input.format"),
            ({"type": "nonsense.event"}, "type"),
            ({"type": "input_audio_buffer.append", "audio": "A" * (MAX_APPEND_CHARS + 4)},
             "audio"),
            ({"type": "response.cancel", "response_id": "resp_x"}, "response_id"),
            ({"type": "conversation.item.truncate", "item_id": "nope", "audio_end_ms": 10},
             "item_id"),
        ]
        for event, param in sent:
            socket.send_text(json.dumps(event))
            reply = socket.receive_json()
            assert reply["type"] == "error" and reply["error"]["param"] == param, reply
        # Out of order: an answer before anything was said; a commit of nothing (VAD off).
        socket.send_text(json.dumps({"type": "response.create"}))
        assert socket.receive_json()["error"]["code"] == "conversation_empty"
        socket.send_text(json.dumps({"type": "session.update", "session": {
            "audio": {"input": {"turn_detection": None}}}}))
        updated = socket.receive_json()
        assert updated["type"] == "session.updated"
        assert updated["session"]["audio"]["input"]["turn_detection"] is None
        socket.send_text(json.dumps({"type": "input_audio_buffer.commit"}))
        assert socket.receive_json()["error"]["code"] == "input_audio_buffer_commit_empty"
        socket.send_text("{not json")
        assert socket.receive_json()["error"]["code"] == "invalid_json"
        socket.send_text(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user", "content": [{"type": "input_text",
                                                            "text": "Hello"}]}}))
        added = socket.receive_json()
        assert added["type"] == "conversation.item.added"
        assert added["item"]["content"] == [{"type": "input_text", "text": "Hello"}]
        assert socket.receive_json()["type"] == "conversation.item.done"
    # The session ended: its place and its admission slot are free again.
    assert routes.sessions == 0 and routes.admission.running == 0
    with client.websocket_connect("/v1/realtime?model=chat", headers=auth) as socket:
        assert socket.receive_json()["type"] == "session.created"


def test_an_unknown_model_is_an_error_naming_model(
        served: tuple[TestClient, RealtimeRoutes]) -> None:
    client, _ = served
    with client.websocket_connect("/v1/realtime?model=whisper",
                                  headers={"Authorization": f"Bearer {KEY}"}) as socket:
        reply = socket.receive_json()
        assert reply["type"] == "error" and reply["error"]["param"] == "model"


def test_a_silent_session_is_closed_after_the_idle_timeout(core: GatewayCore) -> None:
    routes = RealtimeRoutes(core, ApiKeys(), Admission(None, 8), RealtimeLimits(
        max_sessions=2, idle_timeout_s=0.2, max_buffer_seconds=0.05))
    app = Starlette(routes=[WebSocketRoute("/v1/realtime", routes.realtime)])
    with TestClient(app) as client, client.websocket_connect("/v1/realtime") as socket:
        assert socket.receive_json()["type"] == "session.created"  # keys off: no key needed
        # The operator's buffer limit (VAD off: audio waits for a commit): 0.1 s is too much.
        socket.send_text(json.dumps({"type": "session.update", "session": {
            "audio": {"input": {"turn_detection": None}}}}))
        assert socket.receive_json()["type"] == "session.updated"
        socket.send_text(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(
            bytes(4800)).decode()}))
        full = socket.receive_json()["error"]
        assert full["code"] == "input_audio_buffer_full" and full["param"] == "audio", full
        idle = socket.receive_json()
        assert idle["type"] == "error" and idle["error"]["code"] == "session_idle_timeout"
        with pytest.raises(WebSocketDisconnect):
            socket.receive_json()
    assert routes.sessions == 0


def test_realtime_limits_are_serve_and_gateway_flags() -> None:
    from stagemesh.cli import build_parser
    from stagemesh.commands.serving import _gateway_config

    for command in ("serve", "gateway"):
        args = build_parser().parse_args([
            command, "--realtime-max-sessions", "3", "--realtime-idle-timeout", "30",
            "--realtime-max-buffer-seconds", "60"])
        assert _gateway_config(args).realtime == RealtimeLimits(3, 30.0, 60.0)
    assert _gateway_config(build_parser().parse_args(["serve"])).realtime == RealtimeLimits()
    with pytest.raises(SystemExit, match="max_sessions must be at least 1"):
        _gateway_config(build_parser().parse_args(["gateway", "--realtime-max-sessions", "0"]))
