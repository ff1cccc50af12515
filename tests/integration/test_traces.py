"""Traces over a real mesh: `stagemesh serve` (tokenizer, DiT and VAE processes + the gateway)
with the standard OTEL_* variables pointing at an OTLP/HTTP receiver run by this test.

What is checked: one request is one trace, with spans from the gateway and from every stage
process it touched (each process names itself in `service.name`), each stage's server span a
child of the gateway's client span for that call; the DiT's trace shows queue wait, prepare,
the step loop with one event per step, and finish; a cancelled request shows an abort span with
its reason and latency; and the stage's log line for the cancel carries the trace id.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from stagemesh.serve import free_port
from stagemesh.shared.proto.v1 import gateway_service_pb2, gateway_service_pb2_grpc

pytestmark = pytest.mark.timeout(300)

START_TIMEOUT_S = 240.0  # as the e2e tier: a busy 2-core machine loads torch slowly
SPAN_WAIT_S = 20.0
POLL_S = 0.1
MESH_SERVICES = {"stagemesh-gateway", "stagemesh-tokenizer", "stagemesh-dit", "stagemesh-vae"}
RECIPE = """\
recipes:
  - name: tiny-shapes
    task: text-to-image
    model: builtin:tiny-shapes
    stages:
      tokenizer: {{address: "127.0.0.1:{tokenizer}"}}
      dit: {{address: "127.0.0.1:{dit}", options: {{max_steps: 1000}}}}
      vae: {{address: "127.0.0.1:{vae}"}}
    defaults: {{width: 32, height: 32, num_inference_steps: 4, true_cfg_scale: 4.0,
                negative_prompt: ""}}
"""


def _value(value: AnyValue) -> object:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, object]
    events: list[tuple[str, dict[str, object]]]
    start_ns: int
    end_ns: int


@dataclass
class Receiver:
    """An OTLP/HTTP trace receiver: decodes ExportTraceServiceRequest bodies into spans."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service=str(resource.get("service.name")), name=span.name,
                        trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        events=[(e.name, {a.key: _value(a.value) for a in e.attributes})
                                for e in span.events],
                        start_ns=span.start_time_unix_nano, end_ns=span.end_time_unix_nano))
        with self.lock:
            self.spans.extend(received)

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [span for span in self.spans if span.trace_id == trace_id]

    def with_attribute(self, key: str, value: object) -> list[ReceivedSpan]:
        with self.lock:
            return [span for span in self.spans if span.attributes.get(key) == value]


def _serve_receiver(receiver: Receiver) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            if self.path != "/v1/traces":
                self.send_error(404)
                return
            receiver.add(body)
            reply = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@dataclass
class TracedMesh:
    http_url: str
    grpc_target: str
    receiver: Receiver
    log_path: Path

    def wait_for_spans(self, trace_id: str, services: set[str],
                       names: frozenset[str] = frozenset()) -> list[ReceivedSpan]:
        """The spans of `trace_id`, once every service in `services` has sent some and every
        span name in `names` has shown up (a server span ends, so is exported, after the
        client spans it contains: a batch may carry those first)."""
        deadline = time.monotonic() + SPAN_WAIT_S
        while time.monotonic() < deadline:
            spans = self.receiver.of_trace(trace_id)
            if services <= {s.service for s in spans} and names <= {s.name for s in spans}:
                return spans
            time.sleep(POLL_S)
        raise AssertionError(f"trace {trace_id}: wanted {services}; got "
                             f"{sorted({(s.service, s.name) for s in spans})}")

    def wait_for_trace(self, request_id: str, services: set[str],
                       names: set[str]) -> list[ReceivedSpan]:
        """The spans of the trace the gateway started for `request_id`, once every service in
        `services` and every span name in `names` has shown up in it."""
        deadline = time.monotonic() + SPAN_WAIT_S
        spans: list[ReceivedSpan] = []
        while time.monotonic() < deadline:
            roots = self.receiver.with_attribute("stagemesh.request_id", request_id)
            gateway = [s for s in roots if s.service == "stagemesh-gateway"]
            if gateway:
                spans = self.receiver.of_trace(gateway[0].trace_id)
                if services <= {s.service for s in spans} and names <= {s.name for s in spans}:
                    return spans
            time.sleep(POLL_S)
        seen = sorted({(s.service, s.name) for s in spans})
        raise AssertionError(f"trace of {request_id}: wanted {services} and {names}; got {seen}")


@pytest.fixture(scope="module")
def traced_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TracedMesh]:
    receiver = Receiver()
    otlp = _serve_receiver(receiver)
    folder = tmp_path_factory.mktemp("traces")
    recipe = folder / "recipe.yaml"
    recipe.write_text(RECIPE.format(tokenizer=free_port(), dit=free_port(), vae=free_port()))
    log_path = folder / "serve.log"
    http_port, grpc_port = free_port(), free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{otlp.server_port}",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    env.pop("STAGEMESH_API_KEYS", None)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "stagemesh", "serve", "--recipes", str(recipe),
             "--http-port", str(http_port),
             "--grpc-port", str(grpc_port)], env=env, stderr=log, stdout=log)
    mesh = TracedMesh(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", receiver,
                      log_path)
    try:
        _wait_healthy(mesh.http_url, process)
        yield mesh
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        otlp.shutdown()


def _wait_healthy(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"stagemesh serve exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("stagemesh serve did not become healthy")


def _one(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    matching = [s for s in spans if s.service == service and s.name == name]
    assert len(matching) == 1, (service, name, [(s.service, s.name) for s in spans])
    return matching[0]


def test_a_request_is_one_trace_across_the_gateway_and_every_stage(
        traced_mesh: TracedMesh) -> None:
    request_id = f"traced-{time.monotonic_ns()}"
    response = httpx.post(f"{traced_mesh.http_url}/v1/images/generations", timeout=60,
                          headers={"x-request-id": request_id},
                          json={"prompt": "a red circle", "num_inference_steps": 4, "seed": 1})
    assert response.status_code == 200, response.text

    spans = traced_mesh.wait_for_trace(
        request_id, MESH_SERVICES,
        {"EncodePrompt", "Denoise", "DecodeLatents", "steps", "finish"})
    assert len({s.trace_id for s in spans}) == 1
    server = _one(spans, "stagemesh-gateway", "POST /v1/images/generations")
    assert server.parent_span_id == "" and server.attributes["http.response.status_code"] == 200
    for stage, rpc in (("tokenizer", "EncodePrompt"), ("dit", "Denoise"),
                       ("vae", "DecodeLatents")):
        client = _one(spans, "stagemesh-gateway", f"stage {stage}")
        stage_span = _one(spans, f"stagemesh-{stage}", rpc)
        assert stage_span.parent_span_id == client.span_id, stage
        assert stage_span.start_ns >= client.start_ns - 50_000_000  # clocks of one machine

    denoise = _one(spans, "stagemesh-dit", "Denoise")
    dit = {s.name: s for s in spans if s.parent_span_id == denoise.span_id}
    assert {"queue wait", "prepare", "steps", "finish"} <= set(dit), sorted(dit)
    steps = [attributes for name, attributes in dit["steps"].events if name == "step"]
    assert [step["step_index"] for step in steps] == [1, 2, 3, 4]
    assert all(step["total_steps"] == 4 and float(str(step["step_seconds"])) > 0
               for step in steps)
    # in time order: queue wait, prepare, the steps, finish
    assert (dit["queue wait"].end_ns <= dit["prepare"].start_ns + 1_000_000
            and dit["prepare"].end_ns <= dit["steps"].start_ns + 1_000_000
            and dit["steps"].end_ns <= dit["finish"].end_ns)
    assert "abort" not in dit


def test_a_cancelled_request_shows_an_abort_span_with_reason_and_latency(
        traced_mesh: TracedMesh) -> None:
    request_id = f"traced-cancel-{time.monotonic_ns()}"
    with httpx.stream("POST", f"{traced_mesh.http_url}/v1/images/generations", timeout=60,
                      headers={"x-request-id": request_id},
                      json={"prompt": "a blue square", "num_inference_steps": 1000,
                            "stream": True}) as response:
        for line in response.iter_lines():
            event = json.loads(line[len("data: "):]) if line.startswith("data: {") else {}
            if event.get("type") == "progress" and event.get("stage") == "dit":
                cancel = httpx.post(
                    f"{traced_mesh.http_url}/v1/requests/{request_id}/cancel", timeout=30)
                assert cancel.status_code == 200, cancel.text
                break

    spans = traced_mesh.wait_for_trace(
        request_id, {"stagemesh-gateway", "stagemesh-dit"}, {"abort"})
    abort = _one(spans, "stagemesh-dit", "abort")
    assert abort.attributes["stagemesh.abort.reason"] == "cancelled"
    latency = float(str(abort.attributes["stagemesh.abort.latency_seconds"]))
    assert 0 <= latency < 5
    assert 1 <= int(str(abort.attributes["stagemesh.abort.step_index"])) < 1000
    assert abs((abort.end_ns - abort.start_ns) / 1e9 - latency) < 0.01
    assert not [s for s in spans if s.service == "stagemesh-vae"], "no VAE after a cancel"

    trace_id = abort.trace_id
    log_lines = traced_mesh.log_path.read_text(errors="replace").splitlines()
    assert any(f"rid={request_id} trace={trace_id}" in line and "cancel received" in line
               for line in log_lines), "the stage's cancel log line carries the trace id"


def test_a_grpc_call_continues_the_callers_trace(traced_mesh: TracedMesh) -> None:
    trace_id, parent_id = f"{time.time_ns():032x}", "00f067aa0ba902b7"
    with grpc.insecure_channel(traced_mesh.grpc_target) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        events = list(stub.GenerateImage(
            gateway_service_pb2.GenerateImageRequest(prompt="a green triangle", width=32,
                                                     height=32, num_inference_steps=2, seed=5),
            metadata=(("traceparent", f"00-{trace_id}-{parent_id}-01"),), timeout=60))
    assert events[-1].WhichOneof("event") == "result"

    spans = traced_mesh.wait_for_spans(
        trace_id, MESH_SERVICES, frozenset({"stagemesh.v1.GatewayService/GenerateImage"}))
    server = _one(spans, "stagemesh-gateway", "stagemesh.v1.GatewayService/GenerateImage")
    assert server.parent_span_id == parent_id
    assert _one(spans, "stagemesh-dit", "Denoise").parent_span_id == _one(
        spans, "stagemesh-gateway", "stage dit").span_id
