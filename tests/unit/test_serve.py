"""`stagemesh serve` planning, without starting a stage: free ports, one launch per address,
models prepared by child processes, and a serve process that never imports a model library."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from stagemesh.gateway.recipes import Recipe, StageEndpoint, Task
from stagemesh.launcher import LAUNCHER_ENV, StartMode, start_mode
from stagemesh.models.registry import resolve_model
from stagemesh.serve import (
    StageLaunch,
    plan_launches,
    prepare_models,
    stage_command,
    with_free_ports,
)
from stagemesh.shared import process as cli  # the stage's process tuning, once in cli.py

FORBIDDEN = ("torch", "diffusers", "transformers", "stagemesh.models")

#: Imports what `stagemesh serve` runs in its own process and builds the parser; prints the
#: forbidden modules that got loaded.
PROBE = """
import json, sys
import stagemesh.cli, stagemesh.gateway.app, stagemesh.serve
stagemesh.cli.build_parser().parse_args(["serve"])
forbidden = json.loads(sys.argv[1])
print(json.dumps(sorted(m for m in sys.modules
                        if any(m == f or m.startswith(f + ".") for f in forbidden))))
"""


def _image_recipe(name: str, model: str, port: int) -> Recipe:
    stages = {
        "tokenizer": StageEndpoint("tokenizer", f"127.0.0.1:{port}", 9161,
                                   {"max_prompt_chars": 100}),
        "dit": StageEndpoint("dit", f"127.0.0.1:{port + 1}", None, {"step_execution": False}),
        "vae": StageEndpoint("vae", f"127.0.0.1:{port + 2}"),
    }
    return Recipe(name=name, task=Task.TEXT_TO_IMAGE, model=model, stages=stages)


def test_the_serve_process_imports_no_model_library() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE, json.dumps(FORBIDDEN)],
                            capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_with_free_ports_moves_every_stage_and_keeps_shared_stages_shared() -> None:
    recipes = {"a": _image_recipe("a", "builtin:tiny-shapes", 50061),
               "b": _image_recipe("b", "builtin:tiny-shapes", 50061)}
    moved = with_free_ports(recipes)
    assert list(moved) == ["a", "b"]
    for name in ("tokenizer", "dit", "vae"):
        before, after = recipes["a"].stages[name], moved["a"].stages[name]
        assert after.address != before.address and after.host == "127.0.0.1"
        assert (after.name, after.options) == (before.name, before.options)
        assert (after.metrics_port is None) == (before.metrics_port is None)
        assert moved["b"].stages[name] == after  # one stage serving both recipes stays one
    addresses = {endpoint.address for endpoint in moved["a"].stages.values()}
    assert len(addresses) == 3


def test_plan_launches_starts_each_address_once_with_its_recipes_model(tmp_path: Path) -> None:
    shapes, other = tmp_path / "shapes", tmp_path / "other"
    recipes = {"a": _image_recipe("a", "builtin:tiny-shapes", 50061),
               "b": _image_recipe("b", "builtin:tiny-shapes", 50061),
               "c": _image_recipe("c", str(other), 50071)}
    launches = plan_launches(recipes, {"builtin:tiny-shapes": shapes, str(other): other})
    assert [(launch.endpoint.address, launch.model_dir) for launch in launches] == [
        ("127.0.0.1:50061", shapes), ("127.0.0.1:50062", shapes), ("127.0.0.1:50063", shapes),
        ("127.0.0.1:50071", other), ("127.0.0.1:50072", other), ("127.0.0.1:50073", other)]
    assert launches[1].endpoint.options == {"step_execution": False}


def test_prepare_models_resolves_each_distinct_spec_in_one_child(tmp_path: Path) -> None:
    folders = prepare_models([str(tmp_path), "builtin:tiny-shapes", str(tmp_path)])
    assert list(folders) == [str(tmp_path), "builtin:tiny-shapes"]
    assert folders[str(tmp_path)] == tmp_path
    assert (folders["builtin:tiny-shapes"] / "model_index.json").is_file()


def test_prepare_models_names_the_spec_that_failed(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="'builtin:no-such-model'"):
        prepare_models([str(tmp_path), "builtin:no-such-model", "builtin:tiny-shapes"])
    with pytest.raises(RuntimeError, match="'builtin:no-such-model'"):
        prepare_models(["builtin:no-such-model", str(tmp_path)])


def test_model_prepare_command_prints_only_the_folder_and_refuses_a_bad_spec(
        tmp_path: Path) -> None:
    command = [sys.executable, "-m", "stagemesh", "model", "prepare"]
    ok = subprocess.run([*command, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert (ok.returncode, ok.stdout) == (0, f"{tmp_path}\n")
    missing = tmp_path / "missing"
    bad = subprocess.run([*command, str(missing)], capture_output=True, text=True, timeout=60)
    assert (bad.returncode, bad.stdout) == (1, "")
    assert bad.stderr.strip() == f"stagemesh model prepare: model folder {missing} does not exist"
    several = subprocess.run([*command, str(tmp_path), "builtin:tiny-shapes"],
                             capture_output=True, text=True, timeout=60)
    assert several.returncode == 0
    assert several.stdout.splitlines() == [str(tmp_path), str(resolve_model("builtin:tiny-shapes"))]


@pytest.fixture
def four_cores(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A process allowed on four CPUs, in no CPU-limited cgroup, with no thread override."""
    monkeypatch.setattr(cli.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(cli, "CGROUP_CPU_MAX", tmp_path / "no-cgroup")
    monkeypatch.delenv(cli.THREADS_ENV, raising=False)


@pytest.mark.usefixtures("four_cores")
@pytest.mark.parametrize(("cpu_max", "cores"), [
    ("max 100000\n", 4), ("150000 100000\n", 2), ("800000 100000\n", 4), ("junk", 4)])
def test_usable_cores_respect_a_containers_cpu_limit(tmp_path: Path, cpu_max: str,
                                                     cores: int) -> None:
    limit = tmp_path / "cpu.max"
    limit.write_text(cpu_max)
    assert cli.usable_cores(limit) == cores


@pytest.mark.usefixtures("four_cores")
def test_heavy_stages_get_every_usable_core_and_light_stages_one() -> None:
    assert {name: cli.stage_threads(name) for name in
            ("tokenizer", "dit", "vae", "talker", "codec")} == {
        "tokenizer": 1, "dit": 4, "vae": 1, "talker": 4, "codec": 1}
    assert cli.stage_threads("transcriber") == 4  # a turn's decode is on the answer's path


@pytest.mark.usefixtures("four_cores")
def test_threads_given_on_the_command_line_or_in_the_environment_win(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cli.THREADS_ENV, "3")
    assert (cli.stage_threads("dit"), cli.stage_threads("vae")) == (3, 3)
    assert cli.stage_threads("dit", given=2) == 2
    monkeypatch.setenv(cli.THREADS_ENV, "many")
    with pytest.raises(SystemExit, match="STAGEMESH_THREADS must be a whole number"):
        cli.stage_threads("dit")
    with pytest.raises(SystemExit, match="at least 1"):
        cli.stage_threads("dit", given=0)


@pytest.mark.usefixtures("four_cores")
def test_serve_starts_each_stage_with_its_thread_count(tmp_path: Path) -> None:
    recipe = _image_recipe("a", "builtin:tiny-shapes", 50061)
    threads = {}
    for name, endpoint in recipe.stages.items():
        command = stage_command(StageLaunch(endpoint, tmp_path))
        threads[name] = command[command.index("--threads") + 1]
        assert command[command.index("stage") + 1] == name
    assert threads == {"tokenizer": "1", "dit": "4", "vae": "1"}


@pytest.mark.usefixtures("four_cores")
@pytest.mark.parametrize(("replicas", "threads"), [(2, "2"), (3, "1"), (8, "1")])
def test_the_replicas_of_a_heavy_stage_share_the_cores(tmp_path: Path, replicas: int,
                                                       threads: str) -> None:
    ports = ",".join(f"127.0.0.1:{50200 + i}" for i in range(replicas))
    recipe = dataclasses.replace(_image_recipe("a", "builtin:tiny-shapes", 50061), stages={
        "dit": StageEndpoint("dit", f"ipv4:{ports}"), "vae": StageEndpoint("vae", "127.0.0.1:9")})
    launches = plan_launches({"a": recipe}, {"builtin:tiny-shapes": tmp_path})
    commands = {launch.address: stage_command(launch) for launch in launches}
    assert len(commands) == replicas + 1
    assert {address: command[command.index("--threads") + 1]
            for address, command in commands.items()} == {
        **{f"127.0.0.1:{50200 + i}": threads for i in range(replicas)}, "127.0.0.1:9": "1"}


def test_openmp_threads_sleep_when_idle_unless_the_operator_says_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cli.quiet_openmp_waits()
    assert cli.os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    cli.quiet_openmp_waits()
    assert cli.os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


#: A step's allocations, as an engine thread makes them: three 8 MB buffers freed together.
_STEPS_ON_A_THREAD = """\
import resource, sys, threading
import numpy as np
from stagemesh.shared import process
if sys.argv[1] == "keep":
    process.keep_freed_memory()

def steps():
    first = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(int(sys.argv[2])):
        buffers = [np.ones(1 << 20) for _ in range(3)]  # written, so every page is touched
        del buffers
    print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - first)

thread = threading.Thread(target=steps)
thread.start()
thread.join()
"""


def _page_faults(mode: str, steps: int, env: dict[str, str] | None = None) -> int:
    done = subprocess.run([sys.executable, "-c", _STEPS_ON_A_THREAD, mode, str(steps)],
                          capture_output=True, text=True, check=True,
                          env={**cli.os.environ, **(env or {})})
    return int(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_stage_thread_reuses_what_its_last_step_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in cli.MALLOC_TUNING_ENV:
        monkeypatch.delenv(name, raising=False)
    kept_2, kept_40 = _page_faults("keep", 2), _page_faults("keep", 40)
    assert kept_40 < 1.5 * kept_2  # steps after the first fault nothing in again
    # Without it, glibc hands each step's memory back and the next step faults it in again;
    # an operator's own malloc tuning is left alone.
    assert _page_faults("default", 40) > 5 * kept_40
    assert _page_faults("keep", 40, {"MALLOC_TRIM_THRESHOLD_": "131072"}) > 5 * kept_40


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="spawn is the only mode there")
def test_stages_are_forked_unless_the_operator_asks_for_spawn() -> None:
    assert start_mode({}) is StartMode.FORK
    assert start_mode({LAUNCHER_ENV: "spawn"}) is StartMode.SPAWN
    assert start_mode({LAUNCHER_ENV: " Fork "}) is StartMode.FORK
    with pytest.raises(SystemExit, match=f"{LAUNCHER_ENV} must be one of"):
        start_mode({LAUNCHER_ENV: "0"})
