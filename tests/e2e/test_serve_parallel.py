"""`stagemesh serve` with a parallel DiT, as an operator runs it: a recipe whose DiT is one group
of 4 CPU ranks (`parallel_cfg: 2` x `parallel_ulysses: 2`, 1 thread each: the stage process is
rank 0 and starts 3 workers) answers over REST and gRPC; a rank killed mid-request is a group
fault: the requests it ran fail (REST 503 naming the stage, gRPC UNAVAILABLE), the stage turns
NOT_SERVING and exits, serve restarts the whole group and it serves again; the shipped LoRA
adapter runs on the group. One serve start for the module (tiny-shapes: the cheapest model whose
4 heads split among 2 Ulysses ranks)."""

from __future__ import annotations

import base64
import io
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from PIL import Image

from stagemesh.commands.stage import GROUP_WORKER_COMMAND
from stagemesh.models.tiny_shapes.lora import SHIPPED_LORA_DIR, shows_style
from stagemesh.serve import HEALTH_CHECK_METHOD
from stagemesh.shared.proto.v1 import gateway_service_pb2 as pb
from stagemesh.shared.proto.v1 import gateway_service_pb2_grpc

from .conftest import Served, process_tree, stage_processes, start_serve, stop_serve
from .test_serve_replicas import _alive

pytestmark = pytest.mark.timeout(600)

RECIPE = """
recipes:
  - name: tiny-shapes
    task: text-to-image
    model: builtin:tiny-shapes
    stages:
      tokenizer: {address: "127.0.0.1:1"}
      dit: {address: "127.0.0.1:2", metrics_port: 2,
            options: {parallel_cfg: 2, parallel_ulysses: 2, max_steps: 1000,
                      drain_grace_s: 1, lora_dir: "%s"}}
      vae: {address: "127.0.0.1:3"}
    defaults: {width: 32, height: 32, num_inference_steps: 4, true_cfg_scale: 4.0,
               negative_prompt: ""}
"""
#: A request still denoising when the rank dies (milliseconds a step here).
LONG_STEPS = 1000
#: What a worker's command line says (forked from the group's own launcher: 4 ranks).
WORKER_COMMAND = GROUP_WORKER_COMMAND
#: How often the health watcher asks the DiT stage (its NOT_SERVING lasts about a second).
HEALTH_POLL_S = 0.02


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    recipe = tmp_path_factory.mktemp("parallel") / "recipe.yaml"
    recipe.write_text(RECIPE % SHIPPED_LORA_DIR)
    served = start_serve("--recipes", str(recipe))
    yield served
    assert stop_serve(served) == 0


def _dit(served: Served) -> int | None:
    """The DiT stage's pid (rank 0); None while there is none (being restarted)."""
    pids = [p for p, cmd in stage_processes(served.process.pid).items()
            if " stage dit " in f" {cmd} "]
    assert len(pids) <= 1, pids
    return pids[0] if pids else None


def _workers(pid: int) -> list[int]:
    """The pids of a DiT stage's workers (its ranks 1..)."""
    return sorted(p for p, cmd in process_tree(pid).items() if WORKER_COMMAND in cmd)


def _dit_address(served: Served) -> str:
    return served.stages()["dit"]["address"]


def _rest(served: Served, steps: int, seed: int, **fields: object) -> httpx.Response:
    return httpx.post(f"{served.http_url}/v1/images/generations", timeout=300, json={
        "prompt": "a red circle on the left", "seed": seed, "num_inference_steps": steps,
        "response_format": "b64_json", **fields})


def _grpc(served: Served, steps: int, seed: int) -> list[pb.GenerateImageResponse]:
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = gateway_service_pb2_grpc.GatewayServiceStub(channel)
        return list(stub.GenerateImage(pb.GenerateImageRequest(
            prompt="a red circle on the left", width=32, height=32, seed=seed,
            num_inference_steps=steps), timeout=300))


def _png(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG"
    return image


def _health(address: str) -> str:
    """The stage's grpc.health status name (open without the mesh token), or UNREACHABLE."""
    with grpc.insecure_channel(address) as channel:
        check = channel.unary_unary(
            HEALTH_CHECK_METHOD,
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString)
        try:
            reply = check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return "UNREACHABLE"
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))


def test_a_parallel_dit_serves_rest_and_grpc(served: Served) -> None:
    pid = _dit(served)
    assert pid is not None
    assert len(_workers(pid)) == 3  # a group of 4 ranks: the stage process and 3 workers
    dit: Mapping[str, object] = served.stages()["dit"]  # GET /v1/stages
    assert dit["health"] == "SERVING"
    assert (dit["parallel_cfg"], dit["parallel_ulysses"]) == (2, 2)
    assert dit["group_devices"] == ["cpu"] * 4
    response = _rest(served, 4, seed=7)
    assert response.status_code == 200, response.text
    rest_png = base64.b64decode(response.json()["data"][0]["b64_json"])
    assert _png(rest_png).size == (32, 32)
    events = _grpc(served, 4, seed=7)
    kinds = [event.WhichOneof("event") for event in events]
    assert kinds[-1] == "result"
    steps = [e.progress.step_index for e in events
             if e.stage == "dit" and e.WhichOneof("event") == "progress"]
    assert steps == [1, 2, 3, 4]
    # the same request over either API: the same pixels from the same group
    assert events[-1].result.images[0].png == rest_png


def test_the_shipped_lora_adapter_runs_on_the_group(served: Served) -> None:
    """`night` paints the background black on every rank's rows and tokens (exactness against
    one device: tests/model/test_dit_parallel.py)."""
    def image(**fields: object) -> np.ndarray:
        response = _rest(served, 12, seed=3, **fields)
        assert response.status_code == 200, response.text
        return np.asarray(_png(base64.b64decode(response.json()["data"][0]["b64_json"]))
                          .convert("RGB"))

    assert not shows_style(image())
    assert shows_style(image(lora=[{"name": "night", "scale": 1.0}]))


def test_a_killed_rank_fails_its_requests_then_serve_restarts_the_group(
        served: Served, wait_until: Callable[..., None]) -> None:
    """Runs last: it ends the first group."""
    address = _dit_address(served)
    pid = _dit(served)
    assert pid is not None
    workers = _workers(pid)
    seen: list[str] = []
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            status = _health(address)
            if not seen or seen[-1] != status:
                seen.append(status)
            # fast until the fault shows, then at a restart's pace
            watching.wait(HEALTH_POLL_S if "NOT_SERVING" not in seen else 0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    with ThreadPoolExecutor(2) as pool:
        rest: Future[httpx.Response] = pool.submit(_rest, served, LONG_STEPS, 1)
        over_grpc: Future[list[pb.GenerateImageResponse]] = pool.submit(
            _grpc, served, LONG_STEPS, 2)
        wait_until(lambda: served.metric("dit", "stagemesh_requests_running") >= 2,
                   timeout=120, what="both requests running on the group")
        watcher.start()
        os.kill(workers[1], signal.SIGKILL)
        response = rest.result()
        with pytest.raises(grpc.RpcError) as failed:
            over_grpc.result()
    assert response.status_code == 503, response.text
    assert f"dit stage at {address}" in response.json()["error"]["message"]
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE

    wait_until(lambda: _dit(served) not in (None, pid)
               and served.stages()["dit"]["health"] == "SERVING",
               timeout=240, what="serve restarting the DiT group and the gateway seeing it")
    wait_until(lambda: seen[-1] == "SERVING", timeout=10, what="the watcher seeing it serve")
    watching.set()
    watcher.join()
    assert seen[0] == "SERVING", seen
    assert "NOT_SERVING" in seen, seen  # the group fault, before the process went away
    new = _dit(served)
    assert new is not None
    new_workers = _workers(new)
    assert len(new_workers) == 3 and not set(new_workers) & set(workers)
    wait_until(lambda: not any(_alive(p) for p in [pid, *workers]), timeout=30,
               what="every rank of the first group gone")  # the group failed as one
    response = _rest(served, 4, seed=7)
    assert response.status_code == 200, response.text
