"""The Kubernetes manifests (k8s/), rendered with `kubectl kustomize` and checked against the code.

Schema validation is tools/check_k8s.sh's job; these tests check what a schema cannot: that the
probes, Services, autoscalers and recipes agree with each other and with how the app runs.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from stagemesh.gateway.recipes import load_recipes
from stagemesh.shared.engine.metrics import EngineMetrics
from stagemesh.shared.stage_runtime import SHUTDOWN_GRACE_S

K8S = Path(__file__).resolve().parents[2] / "k8s"
KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None,
                                reason="kubectl is not on PATH (needed for `kubectl kustomize`)")

STAGES = ("tokenizer", "dit", "vae", "talker", "codec")
#: The stages that compute on a GPU in the gpu overlay (the real Qwen-Image text encoder is a
#: 7B-parameter Qwen2.5-VL, so the tokenizer needs one too; the codec stays on CPU).
GPU_STAGES = {"tokenizer", "dit", "vae", "talker"}
QUEUE_METRIC = "stagemesh_requests_waiting"
#: The gateway's own shutdown: up to 10 s for HTTP requests, then 5 s for gRPC (gateway/app.py).
GATEWAY_DRAIN_S = 15
OVERLAYS = ("base", "overlays/cpu-tiny", "overlays/gpu")
AUTOSCALED = ("base", "overlays/gpu")

Doc = dict[str, Any]


@functools.cache
def render(overlay: str) -> tuple[Doc, ...]:
    result = subprocess.run([str(KUBECTL), "kustomize", str(K8S / overlay)], check=True,
                            capture_output=True, text=True, timeout=60)
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def of_kind(overlay: str, kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in render(overlay) if d["kind"] == kind}


def container(deployment: Doc, name: str) -> Doc:
    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    return containers[name]


def flag(args: list[str], name: str) -> str:
    """The value after `name` in a container's args."""
    return args[args.index(name) + 1]


def named(items: list[Doc], name: str) -> Doc:
    """The entry called `name` in a list of ports, volumes or mounts."""
    return next(item for item in items if item["name"] == name)


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_every_stage_has_a_deployment_and_service(overlay: str) -> None:
    for kind in ("Deployment", "Service"):
        assert set(of_kind(overlay, kind)) == {*STAGES, "gateway"}, kind


@pytest.mark.parametrize("overlay", AUTOSCALED)
def test_every_deployment_has_an_autoscaler_on_itself(overlay: str) -> None:
    hpas = of_kind(overlay, "HorizontalPodAutoscaler")
    assert set(hpas) == {*STAGES, "gateway"}
    for name, hpa in hpas.items():
        assert hpa["apiVersion"] == "autoscaling/v2"
        target = hpa["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", name)
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


@pytest.mark.parametrize("overlay", AUTOSCALED)
def test_stage_autoscalers_use_the_queue_metric_with_cpu_fallback(overlay: str) -> None:
    for stage in STAGES:
        metrics = of_kind(overlay, "HorizontalPodAutoscaler")[stage]["spec"]["metrics"]
        pods = [m["pods"]["metric"]["name"] for m in metrics if m["type"] == "Pods"]
        resources = [m["resource"]["name"] for m in metrics if m["type"] == "Resource"]
        assert (pods, resources) == ([QUEUE_METRIC], ["cpu"]), stage


def test_the_queue_metric_is_what_a_stage_exports() -> None:
    registry = CollectorRegistry()
    EngineMetrics("dit", registry=registry).observe_queues(3, 1)
    assert f'{QUEUE_METRIC}{{stage="dit"}} 3.0' in generate_latest(registry).decode()


def test_cpu_tiny_runs_one_replica_of_everything_without_autoscalers() -> None:
    assert of_kind("overlays/cpu-tiny", "HorizontalPodAutoscaler") == {}
    assert of_kind("overlays/cpu-tiny", "PersistentVolumeClaim") == {}
    replicas = {n: d["spec"]["replicas"] for n, d in of_kind("overlays/cpu-tiny",
                                                             "Deployment").items()}
    assert set(replicas.values()) == {1}


def test_stage_probes_ports_and_scrape_annotations_agree(overlay: str) -> None:
    services = of_kind(overlay, "Service")
    for stage, deployment in of_kind(overlay, "Deployment").items():
        if stage == "gateway":
            continue
        stage_container = container(deployment, "stage")
        args = stage_container["args"]
        assert args[:2] == ["stage", stage]
        grpc_port = int(flag(args, "--port"))
        metrics_port = int(flag(args, "--metrics-port"))
        assert flag(args, "--host") == "0.0.0.0"
        assert named(stage_container["ports"], "grpc")["containerPort"] == grpc_port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert stage_container[probe]["grpc"]["port"] == grpc_port, (stage, probe)
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == metrics_port
        ports = services[stage]["spec"]["ports"]
        assert named(ports, "grpc")["targetPort"] in ("grpc", grpc_port)
        assert named(ports, "metrics")["port"] == metrics_port


def test_termination_grace_covers_the_drain(overlay: str) -> None:
    for name, deployment in of_kind(overlay, "Deployment").items():
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        # A stage gives running RPCs SHUTDOWN_GRACE_S, then its engines as long again.
        needed = GATEWAY_DRAIN_S if name == "gateway" else 2 * SHUTDOWN_GRACE_S
        assert grace > needed, name


def test_every_container_runs_as_non_root_without_privileges(overlay: str) -> None:
    for name, deployment in of_kind(overlay, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        for each in [*pod["containers"], *pod.get("initContainers", [])]:
            assert each["securityContext"]["allowPrivilegeEscalation"] is False, name
            assert each["resources"]["limits"]["memory"], name


def test_gateway_serves_the_recipes_config_map_on_its_service_ports(overlay: str) -> None:
    gateway = of_kind(overlay, "Deployment")["gateway"]
    main = container(gateway, "gateway")
    args = main["args"]
    assert args[0] == "gateway"
    assert main["readinessProbe"]["grpc"]["port"] == int(flag(args, "--grpc-port"))
    service_ports = of_kind(overlay, "Service")["gateway"]["spec"]["ports"]
    assert named(service_ports, "http")["port"] == int(flag(args, "--http-port"))
    assert named(service_ports, "grpc")["port"] == int(flag(args, "--grpc-port"))
    mount = named(main["volumeMounts"], "recipes")
    assert Path(flag(args, "--recipes")).parent == Path(mount["mountPath"])
    volume = named(gateway["spec"]["template"]["spec"]["volumes"], "recipes")
    assert volume["configMap"]["name"] in of_kind(overlay, "ConfigMap")


def test_recipes_point_at_the_stage_services(overlay: str, tmp_path: Path) -> None:
    (config_map,) = of_kind(overlay, "ConfigMap").values()
    recipes_file = tmp_path / "recipes.yaml"
    recipes_file.write_text(config_map["data"]["recipes.yaml"])
    recipes = load_recipes(recipes_file)
    services = of_kind(overlay, "Service")
    deployments = of_kind(overlay, "Deployment")
    used = set()
    for recipe in recipes.values():
        for stage, endpoint in recipe.stages.items():
            used.add(stage)
            ports = services[endpoint.host]["spec"]["ports"]
            assert endpoint.host == stage
            assert endpoint.port == named(ports, "grpc")["port"]
            assert endpoint.metrics_port == named(ports, "metrics")["port"]
            # The stage Deployment runs the recipe's model with the recipe's options.
            args = container(deployments[stage], "stage")["args"]
            assert flag(args, "--model") == recipe.model, (recipe.name, stage)
            options = yaml.safe_load(flag(args, "--options")) if "--options" in args else {}
            assert options == endpoint.options, (recipe.name, stage)
    assert used == set(STAGES)


def test_cpu_tiny_builds_each_stage_model_where_the_stage_reads_it() -> None:
    for stage, deployment in of_kind("overlays/cpu-tiny", "Deployment").items():
        if stage == "gateway":
            continue
        pod = deployment["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        spec, target = init["args"]
        assert spec.startswith("builtin:")
        assert init["command"][:2] == ["sh", "-ec"], stage
        assert 'stagemesh model prepare "$0"' in init["command"][2], stage
        assert target == flag(container(deployment, "stage")["args"], "--model"), stage
        models = named(pod["volumes"], "models")
        assert set(models) == {"name", "emptyDir"}, stage


def test_gpu_overlay_gives_gpus_to_the_heavy_stages_only() -> None:
    with_gpu = {name for name, d in of_kind("overlays/gpu", "Deployment").items()
                if "nvidia.com/gpu" in d["spec"]["template"]["spec"]["containers"][0]
                ["resources"]["limits"]}
    assert with_gpu == GPU_STAGES


def _stage_options(deployment: Doc) -> dict[str, object]:
    """A stage's --options (none given: {})."""
    args = container(deployment, "stage")["args"]
    if "--options" not in args:
        return {}
    options: dict[str, object] = yaml.safe_load(flag(args, "--options"))
    return options


def test_gpu_overlay_stages_compute_where_their_hardware_is() -> None:
    """A stage with a GPU computes on it in bfloat16; one without is told to use the CPU (so it
    never picks up a GPU a node's runtime exposes without a request)."""
    for name, deployment in of_kind("overlays/gpu", "Deployment").items():
        if name == "gateway":
            continue
        options = _stage_options(deployment)
        if name in GPU_STAGES:
            assert (options["device"], options["dtype"]) == ("cuda", "bfloat16"), name
        else:
            assert options["device"] == "cpu", name


@pytest.mark.parametrize("overlay", ["base", "overlays/cpu-tiny"])
def test_cpu_overlays_neither_reserve_nor_name_a_gpu(overlay: str) -> None:
    for name, deployment in of_kind(overlay, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        for each in pod["containers"]:
            assert "nvidia.com/gpu" not in each["resources"].get("limits", {}), name
        if name != "gateway":
            assert _stage_options(deployment).get("device", "cpu") == "cpu", name
