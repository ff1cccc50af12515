"""End to end: a request nobody waits for stops costing compute at once.

Each test reads the stages' own Prometheus metrics (through the URLs that GET /v1/stages lists)
before and after, so the claims are about what the DiT and VAE processes actually did.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import ClassVar

import grpc
import httpx
import pytest

from stagemesh.shared.proto.v1 import gateway_service_pb2 as pb
from stagemesh.shared.proto.v1 import gateway_service_pb2_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WaitUntil = Callable[..., None]

SIZE = "256x256"  # larger images make each tiny-model step long enough to observe
LARGE = "512x512"
#: A whole generation timed before and after an abort: enough DiT steps that a DiT still
#: stepping the aborted request (190 steps to go) would show, few enough to keep the test short.
TIMED_STEPS = 10


class Snapshot:
    """Counters of the DiT and VAE stages at one moment."""

    NAMES: ClassVar[dict[str, tuple[str, str, dict[str, str]]]] = {
        "dit_steps": ("dit", "stagemesh_steps_total", {}),
        "dit_aborted": ("dit", "stagemesh_requests_finished_total", {"status": "aborted"}),
        "dit_completed": ("dit", "stagemesh_requests_finished_total", {"status": "completed"}),
        "abort_latency_sum": ("dit", "stagemesh_abort_latency_seconds_sum", {}),
        "step_seconds_sum": ("dit", "stagemesh_step_seconds_sum", {}),
        "step_seconds_count": ("dit", "stagemesh_step_seconds_count", {}),
        "vae_steps": ("vae", "stagemesh_steps_total", {}),
        "vae_finished": ("vae", "stagemesh_requests_finished_total", {"status": "completed"}),
    }

    def __init__(self, served) -> None:
        # the default image recipe's stages (other recipes have a DiT and a VAE too)
        metrics = {stage: served.metrics(stage, "tiny-shapes") for stage in ("dit", "vae")}
        self.values = {}
        for key, (stage, name, labels) in self.NAMES.items():
            wanted = ",".join(f'{k}="{v}"' for k, v in sorted({"stage": stage, **labels}.items()))
            self.values[key] = metrics[stage].get(f"{name}{{{wanted}}}", 0.0)

    def delta(self, later: Snapshot, key: str) -> float:
        return later.values[key] - self.values[key]


def wait_for_aborts(served, before: Snapshot, count: int, wait_until: WaitUntil) -> Snapshot:
    """The DiT's counters once `count` more requests were aborted (the test fails if they are
    not within the wait's deadline)."""
    wait_until(lambda: before.delta(Snapshot(served), "dit_aborted") >= count,
               what=f"{count} more aborted DiT requests")
    return Snapshot(served)


def wait_for_dit_steps(served, before: Snapshot, steps: int, wait_until: WaitUntil) -> None:
    wait_until(lambda: before.delta(Snapshot(served), "dit_steps") >= steps,
               what=f"the DiT running {steps} steps")


def sse_events(response: httpx.Response) -> Iterator[dict]:
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


def timed_generation(served, steps: int) -> float:
    started = time.monotonic()
    response = httpx.post(f"{served.http_url}/v1/images/generations", timeout=120, json={
        "prompt": "a red circle", "size": SIZE, "num_inference_steps": steps, "seed": 1})
    assert response.status_code == 200
    return time.monotonic() - started


def test_stream_reports_queued_each_step_then_the_image(served) -> None:
    with httpx.stream("POST", f"{served.http_url}/v1/images/generations", timeout=60, json={
            "prompt": "a blue square", "size": "64x64", "num_inference_steps": 5, "seed": 3,
            "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(response))
    kinds = [e["type"] for e in events]
    assert kinds[0] == "request" and kinds[-1] == "done" and "image" in kinds
    # an event about one image says which (index and seed); the prompt's are the request's
    assert {"type": "queued", "stage": "dit", "position": 0, "index": 0, "seed": 3} in events
    assert {"type": "queued", "stage": "tokenizer", "position": 0} in events
    dit_steps = [e["step"] for e in events if e["type"] == "progress" and e["stage"] == "dit"]
    assert dit_steps == [1, 2, 3, 4, 5]
    assert all(e["total_steps"] == 5 for e in events if e.get("stage") == "dit"
               and e["type"] == "progress")


def test_disconnect_after_ten_steps_stops_the_dit_and_skips_the_vae(
    served, wait_until: WaitUntil,
) -> None:
    baseline = min(timed_generation(served, TIMED_STEPS) for _ in range(2))
    before = Snapshot(served)
    seen = 0
    with httpx.stream("POST", f"{served.http_url}/v1/images/generations", timeout=60, json={
            "prompt": "a red circle", "size": SIZE, "num_inference_steps": 200,
            "stream": True}) as response:
        for event in sse_events(response):
            if event["type"] == "progress" and event["stage"] == "dit":
                seen = event["step"]
                if seen >= 10:
                    break  # leaving the block closes the connection: the client is gone
    after = wait_for_aborts(served, before, 1, wait_until)

    assert before.delta(after, "dit_aborted") == 1
    assert before.delta(after, "dit_completed") == 0
    steps_run = before.delta(after, "dit_steps")
    assert seen <= steps_run < 200, "the DiT must stop long before its 200 steps"
    mean_step = before.delta(after, "step_seconds_sum") / before.delta(after, "step_seconds_count")
    # Abort latency (cancel signal -> state freed) is at most the step in flight, plus overhead.
    assert before.delta(after, "abort_latency_sum") < 2 * mean_step + 0.25
    assert before.delta(after, "vae_steps") == 0 and before.delta(after, "vae_finished") == 0

    post_abort = timed_generation(served, TIMED_STEPS)
    assert post_abort < 2 * baseline + 0.5, (baseline, post_abort)


def test_cancel_by_id_answers_with_the_stage_step_and_latency(
    served, wait_until: WaitUntil,
) -> None:
    request_id = f"cancel-me-{time.monotonic_ns()}"
    result: dict[str, httpx.Response] = {}

    def generate() -> None:
        result["response"] = httpx.post(
            f"{served.http_url}/v1/images/generations", timeout=120,
            headers={"x-request-id": request_id},
            json={"prompt": "a red circle", "size": LARGE, "num_inference_steps": 200})

    worker = threading.Thread(target=generate)
    before = Snapshot(served)
    worker.start()
    wait_for_dit_steps(served, before, 3, wait_until)
    cancel = httpx.post(f"{served.http_url}/v1/requests/{request_id}/cancel", timeout=30)
    worker.join(timeout=60)

    assert not worker.is_alive(), "the cancelled request must answer"
    assert cancel.status_code == 200, cancel.text
    ack = cancel.json()
    assert ack["request_id"] == request_id and ack["stage"] == "dit"
    assert ack["state"] == "REQUEST_STATE_ABORTED"
    assert 3 <= ack["step_index"] < 200
    assert 0 < ack["abort_latency_seconds"] < 5
    assert result["response"].status_code == 499
    assert result["response"].headers["x-request-id"] == request_id
    after = Snapshot(served)
    assert before.delta(after, "vae_steps") == 0


def test_grpc_cancel_and_deadline_stop_the_dit(served, wait_until: WaitUntil) -> None:
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        before = Snapshot(served)
        call = stub.GenerateImage(pb.GenerateImageRequest(
            prompt="a red circle", width=256, height=256, num_inference_steps=200), timeout=60)
        for event in call:
            if event.stage == "dit" and event.WhichOneof("event") == "progress":
                break
        call.cancel()
        with pytest.raises(grpc.RpcError) as expired:
            for _ in stub.GenerateImage(pb.GenerateImageRequest(
                    prompt="a red circle", width=256, height=256, num_inference_steps=200),
                    timeout=0.8):
                pass
        assert expired.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED

        after = wait_for_aborts(served, before, 2, wait_until)
        assert before.delta(after, "dit_aborted") == 2
        assert before.delta(after, "dit_steps") < 200
        assert before.delta(after, "vae_steps") == 0

        # Cancel by id over gRPC: unknown ids are NOT_FOUND, never a hang.
        with pytest.raises(grpc.RpcError) as unknown:
            stub.CancelRequest(pb.CancelRequestRequest(request_id="nobody"), timeout=10)
        assert unknown.value.code() is grpc.StatusCode.NOT_FOUND


def test_rest_timeout_becomes_the_deadline(served) -> None:
    started = time.monotonic()
    response = httpx.post(f"{served.http_url}/v1/images/generations", timeout=60, json={
        "prompt": "a red circle", "size": SIZE, "num_inference_steps": 200, "timeout": 0.5})
    assert response.status_code == 504
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("timeout", "deadline_exceeded",
                                                              None)
    assert time.monotonic() - started < 10


def test_the_default_mesh_refuses_request_mode(served) -> None:
    """Request mode ignores cancels and deadlines, so only a recipe that allows it (the
    benchmarks') offers it; step/request parity is checked where it is offered
    (tests/integration/test_image_stages.py)."""
    def generate(mode: str) -> httpx.Response:
        return httpx.post(f"{served.http_url}/v1/images/generations", timeout=60, json={
            "prompt": "a green triangle", "size": "64x64", "num_inference_steps": 6,
            "seed": 9, "execution_mode": mode})

    refused = generate("request")
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "execution_mode"
    assert generate("step").status_code == 200


def test_stages_expose_the_cancellation_metrics(served) -> None:
    stages = served.stages()
    assert {"tokenizer", "dit", "vae"} <= set(stages)
    text = httpx.get(stages["dit"]["metrics_url"], timeout=10).text
    for name in ("stagemesh_requests_waiting", "stagemesh_requests_running",
                 "stagemesh_requests_finished_total", "stagemesh_step_seconds",
                 "stagemesh_queue_seconds", "stagemesh_abort_latency_seconds"):
        assert f'{name}' in text and 'stage="dit"' in text



def test_a_non_streaming_client_that_disconnects_cancels_too(
    served, wait_until: WaitUntil,
) -> None:
    before = Snapshot(served)
    host, port = served.http_url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "a red circle", "size": LARGE, "num_inference_steps": 200})
    with socket.create_connection((host, int(port)), timeout=10) as client:
        client.sendall((f"POST /v1/images/generations HTTP/1.1\r\nHost: {host}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                        f"{body}").encode())
        wait_for_dit_steps(served, before, 3, wait_until)
    # The socket is closed: the gateway must notice and stop the DiT.
    after = wait_for_aborts(served, before, 1, wait_until)
    assert before.delta(after, "dit_aborted") == 1
    assert before.delta(after, "dit_steps") < 200
    assert before.delta(after, "vae_steps") == 0
