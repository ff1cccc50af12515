"""`stagemesh serve --replicas dit=2` as an operator runs it: both DiT replicas take work; a
replica killed with -9 fails only the requests it ran (UNAVAILABLE naming the stage) while the
others complete; serve restarts it and it takes traffic again, with the LoRA adapter loaded at
run time before the kill put back by the gateway; `kill -9` of serve leaves no stage
running."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from stagemesh.models.tiny_shapes.lora import NAME, SHIPPED_LORA_DIR

from .conftest import Served, process_tree, stage_processes, start_serve, stop_serve

pytestmark = pytest.mark.timeout(600)

RECIPE = """
recipes:
  - name: tiny-shapes
    task: text-to-image
    model: builtin:tiny-shapes
    stages:
      tokenizer: {address: "127.0.0.1:1"}
      dit: {address: "127.0.0.1:2", metrics_port: 2,
            options: {max_steps: 1000, lora_dir: "LORA_DIR", runtime_lora_updates: true}}
      vae: {address: "127.0.0.1:3"}
    defaults: {width: 32, height: 32, num_inference_steps: 4, true_cfg_scale: 4.0,
               negative_prompt: ""}
"""


@pytest.fixture
def replicated(tmp_path: Path) -> Iterator[Served]:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE.replace("LORA_DIR", str(SHIPPED_LORA_DIR)))
    served = start_serve("--recipes", str(recipe), "--replicas", "dit=2")
    yield served
    if served.process.poll() is None:
        stop_serve(served)


def _dit_pid(served: Served, port: str) -> int | None:
    return next((pid for pid, cmd in stage_processes(served.process.pid).items()
                 if " stage dit " in f" {cmd} " and f"--port {port} " in f"{cmd} "), None)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


#: A runtime name for the shipped adapter (loaded over REST, not found in lora_dir by it).
RUNTIME_LORA = "after-dark"


def _image(served: Served, steps: int, seed: int, lora: str | None = None) -> httpx.Response:
    return httpx.post(f"{served.http_url}/v1/images/generations", timeout=300,
                      json={"prompt": "a red circle", "seed": seed,
                            "num_inference_steps": steps,
                            **({"lora": [{"name": lora}]} if lora else {})})


def _dit_rows(served: Served) -> list[dict[str, str]]:
    stages = httpx.get(f"{served.http_url}/v1/stages", timeout=10).json()["stages"]
    return [stage for stage in stages if stage["name"] == "dit"]


def _running(row: dict[str, str]) -> float:
    return _metric(row, "stagemesh_requests_running")


def _metric(row: dict[str, str], name: str) -> float:
    text = httpx.get(row["metrics_url"], timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f'{name}{{stage="dit"}}'))


def test_a_killed_replica_fails_only_its_requests_and_comes_back(
        replicated: Served, wait_until: Callable[..., None]) -> None:
    rows = _dit_rows(replicated)
    assert len(rows) == 2 and {row["health"] for row in rows} == {"SERVING"}
    loaded = httpx.post(f"{replicated.http_url}/v1/load_lora_adapter", timeout=60,
                        json={"lora_name": RUNTIME_LORA, "lora_path": NAME})
    assert loaded.status_code == 200, loaded.text
    victim = rows[0]
    port = victim["address"].rsplit(":", 1)[1]
    pid = _dit_pid(replicated, port)
    assert pid is not None
    with ThreadPoolExecutor(4) as pool:
        runs: list[Future[httpx.Response]] = [
            pool.submit(_image, replicated, 1000, seed) for seed in range(4)]
        wait_until(lambda: all(_running(row) >= 1 for row in rows), timeout=120,
                   what="requests running on both DiT replicas")
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        responses = [run.result() for run in runs]
    failed = [r for r in responses if r.status_code != 200]
    assert failed and len(failed) < len(responses)  # only the victim's requests failed
    for response in failed:
        assert response.status_code == 503
        assert f"dit stage at {victim['address']}" in response.json()["error"]["message"]
    assert _image(replicated, 4, 9).status_code == 200  # the survivor serves new requests

    wait_until(lambda: (new := _dit_pid(replicated, port)) is not None and new != pid,
               timeout=120, what="serve restarting the killed replica")
    wait_until(lambda: {row["health"] for row in _dit_rows(replicated)} == {"SERVING"},
               timeout=180, what="the restarted replica serving")
    assert time.monotonic() - killed_at < 300
    steps_before = _metric(victim, "stagemesh_steps_total")
    for seed in range(4):  # equal loads take turns: the restarted one gets some, and has it
        assert _image(replicated, 4, seed, RUNTIME_LORA).status_code == 200
    assert _metric(victim, "stagemesh_steps_total") > steps_before

    stages = list(stage_processes(replicated.process.pid))
    assert len(stages) == 4  # tokenizer, two DiT replicas, vae
    children = list(process_tree(replicated.process.pid))  # the stages and their launcher
    replicated.process.kill()  # kill -9 of serve: its stages must not outlive it
    replicated.process.wait()
    wait_until(lambda: not any(_alive(child) for child in children), timeout=90,
               what="every stage process gone after serve was killed")
