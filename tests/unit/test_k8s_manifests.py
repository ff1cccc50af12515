"""The Kubernetes manifests (k8s/), rendered with `kubectl kustomize` and checked against the code.

tools/validate_manifests.py checks each resource against its schema (built-in kinds and the
vendored KEDA CRD); the rest of these tests check what a schema cannot: that the probes,
Services, autoscalers, policies and recipes agree with each other and with how the app runs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from stagemesh.gateway.recipes import DEFAULT_RECIPES, Recipe, load_recipes
from stagemesh.shared.engine.metrics import EngineMetrics
from stagemesh.shared.stage_runtime import (
    DEFAULT_DRAIN_GRACE_S,
    DRAIN_GRACE_OPTION,
    FLUSH_GRACE_S,
    SHUTDOWN_GRACE_S,
)

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
KUBECTL = shutil.which("kubectl")
# `make test` leaves the manifests to these tests (not tools/check_k8s.sh): under CI=true a
# missing kubectl fails them instead of skipping, so a CI cannot pass without checking them.
pytestmark = pytest.mark.skipif(KUBECTL is None and os.environ.get("CI") != "true",
                                reason="kubectl is not on PATH (needed for `kubectl kustomize`)")

#: Stage Deployments, named <recipe>-<role>: each recipe's stages run its own model, so two
#: recipes with a talker have two talker Deployments.
IMAGE_AND_VIDEO_STAGES = tuple(
    f"{recipe}-{role}" for recipe in ("tiny-shapes", "tiny-shapes-edit", "tiny-shapes-video",
                                      "wan-i2v-tiny")
    for role in ("tokenizer", "dit", "vae"))
STAGES = (*IMAGE_AND_VIDEO_STAGES, "piper-joe-talker", "piper-joe-codec", "csm-tiny-talker",
          "csm-tiny-codec", "smollm2-thinker", "whisper-tiny-en-transcriber")
ALL_STAGES = STAGES
#: The stages that compute on a GPU in the gpu overlay (the real Qwen-Image and Wan text
#: encoders are billions of parameters, so the tokenizers need one too; the codecs stay on CPU).
GPU_STAGES = {*IMAGE_AND_VIDEO_STAGES, "csm-tiny-talker", "smollm2-thinker"}
#: Stages that run on ONNX Runtime's CPU provider: they have no `device` option at all.
ONNX_STAGES = {"piper-joe-talker", "piper-joe-codec"}
#: Options only the gpu overlay adds (where a stage computes), on top of default.yaml's.
PLACEMENT_OPTIONS = {"device", "dtype"}
#: The gauges a stage's autoscaler sums: its engines' queue (waiting) and what they run.
QUEUE_METRICS = {"stagemesh_requests_waiting", "stagemesh_requests_running"}
#: The `stage` label values of each stage pod's engines, by role (the VAE and the CSM codec run
#: two: decode, and encode for conditioning images or voice-clone references).
ENGINE_LABELS = {"tokenizer": {"tokenizer"}, "dit": {"dit"}, "vae": {"vae", "vae-encode"},
                 "talker": {"talker"}, "codec": {"codec", "codec-encode"},
                 "thinker": {"thinker"}, "transcriber": {"transcriber"}}
#: The engines of a Piper codec (it decodes only: a Piper voice cannot clone).
PIPER_CODEC_LABELS = {"codec"}
#: The gateway's own shutdown: up to 10 s for HTTP requests, then 5 s for gRPC (gateway/app.py).
GATEWAY_DRAIN_S = 15
#: What a stage needs after its drain grace: abort what is left, let the aborts reach the
#: gateways, exit (shared/stage_runtime.py, drain_stage).
STAGE_EXIT_S = SHUTDOWN_GRACE_S + FLUSH_GRACE_S
#: Metadata keys of KEDA's Prometheus trigger (v2.20.2 pkg/scalers/prometheus_scaler.go), and
#: those it requires. The CRD leaves trigger metadata as free strings, so a misspelt key would
#: reach the cluster unnoticed.
PROMETHEUS_TRIGGER_KEYS = {
    "serverAddress", "query", "queryParameters", "threshold", "activationThreshold", "namespace",
    "customHeaders", "ignoreNullValues", "unsafeSsl", "awsRegion", "timeout", "identityOwner",
}
PROMETHEUS_TRIGGER_REQUIRED = {"serverAddress", "query", "threshold"}
MESH_TOKEN = ("STAGEMESH_MESH_TOKEN", "stagemesh-mesh-token", "token")
API_KEYS = ("STAGEMESH_API_KEYS", "stagemesh-api-keys", "keys")
OVERLAYS = ("base", "overlays/cpu-tiny", "overlays/gpu")

Doc = dict[str, Any]


@functools.cache
def render(overlay: str) -> tuple[Doc, ...]:
    result = subprocess.run([str(KUBECTL), "kustomize", str(K8S / overlay)], check=True,
                            capture_output=True, text=True, timeout=60)
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def of_kind(overlay: str, kind: str) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in render(overlay) if d["kind"] == kind}


def stage_deployments(overlay: str) -> dict[str, Doc]:
    return {n: d for n, d in of_kind(overlay, "Deployment").items() if n != "gateway"}


def pod_labels(deployment: Doc) -> dict[str, str]:
    return {str(k): str(v) for k, v in deployment["spec"]["template"]["metadata"]["labels"].items()}


def role(deployment: Doc) -> str:
    """The stage role a Deployment runs (`stagemesh stage <role>`), from its pod label."""
    return pod_labels(deployment)["stagemesh.io/role"]


def pod_name(deployment: str) -> str:
    """A name the ReplicaSet controller gives a pod of the Deployment."""
    return f"{deployment}-5d8f7b9c4-x7k2p"


def container(deployment: Doc, name: str) -> Doc:
    containers: list[Doc] = deployment["spec"]["template"]["spec"]["containers"]
    return named(containers, name)


def flag(args: list[str], name: str) -> str:
    """The value after `name` in a container's args."""
    return args[args.index(name) + 1]


def named(items: list[Doc], name: str) -> Doc:
    """The entry called `name` in a list of ports, volumes or mounts."""
    found: Doc = next(item for item in items if item["name"] == name)
    return found


def selects(selector: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """Whether a label selector (matchLabels form, or a Service's plain map) matches."""
    wanted = selector.get("matchLabels", selector)
    assert "matchExpressions" not in selector, "selectors here use matchLabels only"
    return all(labels.get(key) == value for key, value in wanted.items())


@functools.cache
def validator() -> ModuleType:
    """tools/validate_manifests.py (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "validate_manifests", ROOT / "tools" / "validate_manifests.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# --- schemas -------------------------------------------------------------------------------


def test_every_resource_validates_against_its_schema(overlay: str) -> None:
    errors = [e for doc in render(overlay) for e in validator().resource_errors(doc, "1.32.0")]
    assert errors == []


def test_the_crd_check_refuses_what_the_api_server_would() -> None:
    """The vendored CRD check fails on an unknown field, a wrong type and a kind it has no
    schema for (kubernetes-validate alone would only warn about all three)."""
    scaled = of_kind("base", "ScaledObject")["tiny-shapes-dit"]
    misspelt = {**scaled, "spec": {**scaled["spec"], "minReplicas": 1}}
    wrong_type = {**scaled, "spec": {**scaled["spec"], "maxReplicaCount": "8"}}
    unknown_kind = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
                    "metadata": {"name": "dit"}, "spec": {}}
    check = validator().resource_errors
    assert check(scaled, "1.32.0") == []
    assert "minReplicas" in " ".join(check(misspelt, "1.32.0"))
    assert "maxReplicaCount" in " ".join(check(wrong_type, "1.32.0"))
    assert "no schema" in " ".join(check(unknown_kind, "1.32.0"))


# --- Services, Deployments, probes -----------------------------------------------------------


def test_every_stage_has_a_deployment_and_a_headless_service(overlay: str) -> None:
    assert set(of_kind(overlay, "Deployment")) == {*ALL_STAGES, "gateway"}
    services = of_kind(overlay, "Service")
    assert set(services) == {*(f"stagemesh-{s}" for s in ALL_STAGES), "gateway"}
    deployments = of_kind(overlay, "Deployment")
    for stage in ALL_STAGES:
        spec = services[f"stagemesh-{stage}"]["spec"]
        # Headless: DNS answers with every ready pod, so the gateway can pick among them.
        assert spec["clusterIP"] == "None", stage
        assert not spec.get("publishNotReadyAddresses", False), stage
        matched = [n for n, d in deployments.items() if selects(spec["selector"], pod_labels(d))]
        assert matched == [stage]
    assert services["gateway"]["spec"].get("clusterIP") != "None"


def test_stage_probes_ports_and_scrape_annotations_agree(overlay: str) -> None:
    services = of_kind(overlay, "Service")
    for stage, deployment in stage_deployments(overlay).items():
        stage_container = container(deployment, "stage")
        args = stage_container["args"]
        assert args[:2] == ["stage", role(deployment)]
        # Named <recipe>-<role>, and labelled with the model folder it loads.
        assert stage.endswith(f"-{role(deployment)}"), stage
        assert flag(args, "--model") == f"/models/{pod_labels(deployment)['stagemesh.io/model']}"
        grpc_port = int(flag(args, "--port"))
        metrics_port = int(flag(args, "--metrics-port"))
        # `stagemesh stage` binds loopback unless told otherwise; a pod must be reachable.
        assert flag(args, "--host") == "0.0.0.0"
        assert named(stage_container["ports"], "grpc")["containerPort"] == grpc_port
        assert named(stage_container["ports"], "metrics")["containerPort"] == metrics_port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert stage_container[probe]["grpc"]["port"] == grpc_port, (stage, probe)
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == metrics_port
        ports = services[f"stagemesh-{stage}"]["spec"]["ports"]
        assert named(ports, "grpc")["targetPort"] in ("grpc", grpc_port)
        assert named(ports, "metrics")["port"] == metrics_port


def _env(each: Doc) -> dict[str, Doc]:
    return {e["name"]: e for e in each.get("env", [])}


def _pre_stop_sleep(each: Doc) -> int:
    """Seconds a container's preStop hook waits (an exec `sleep N`)."""
    command = each["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, command
    return int(command[1])


def test_termination_grace_covers_prestop_and_the_stage_drain(overlay: str) -> None:
    """The kubelet kills a pod terminationGracePeriodSeconds after it starts stopping it, preStop
    included: the stage's whole drain (its drain_grace_s option, or the default) must fit."""
    assert DEFAULT_DRAIN_GRACE_S == 30  # the README and the manifests' comments say so
    for name, deployment in of_kind(overlay, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        main = pod["containers"][0]
        if name == "gateway":
            needed: float = GATEWAY_DRAIN_S
        else:
            drain = _stage_options(deployment).get(DRAIN_GRACE_OPTION, DEFAULT_DRAIN_GRACE_S)
            assert isinstance(drain, int | float), name
            needed = drain + STAGE_EXIT_S
        assert pod["terminationGracePeriodSeconds"] >= _pre_stop_sleep(main) + needed, name


def test_stage_threads_are_picked_by_role_not_pinned(overlay: str) -> None:
    """`stagemesh stage` gives dit and talker every core of its CPU limit and the light stages
    one; a STAGEMESH_THREADS in the pod would override that for every stage alike."""
    for name, deployment in stage_deployments(overlay).items():
        assert "STAGEMESH_THREADS" not in _env(container(deployment, "stage")), name
        assert "--threads" not in container(deployment, "stage")["args"], name


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


def test_the_gateway_reads_no_model_folder(overlay: str) -> None:
    """Voices, limits and devices come from the stages' Describe RPC: the gateway pod mounts
    only its recipes, a scratch /tmp and the video job store (never the models)."""
    gateway = of_kind(overlay, "Deployment")["gateway"]
    volumes = gateway["spec"]["template"]["spec"]["volumes"]
    assert sorted(v["name"] for v in volumes) == ["recipes", "tmp", "videos"]
    assert [v["persistentVolumeClaim"]["claimName"] for v in volumes
            if "persistentVolumeClaim" in v] == ["stagemesh-videos"]
    mounts = {m["name"]: m["mountPath"] for m in container(gateway, "gateway")["volumeMounts"]}
    env = {e["name"]: e.get("value") for e in container(gateway, "gateway")["env"]}
    assert env["STAGEMESH_VIDEO_STORE"] == mounts["videos"]
    assert "--model" not in container(gateway, "gateway")["args"]


def test_the_video_store_is_shared_by_the_gateway_replicas() -> None:
    """Any gateway replica answers for any job: a cluster's store is ReadWriteMany; a one-node
    test cluster's is ReadWriteOnce (all its pods share the node)."""
    for overlay, mode in (("base", "ReadWriteMany"), ("overlays/gpu", "ReadWriteMany"),
                          ("overlays/cpu-tiny", "ReadWriteOnce")):
        claims = of_kind(overlay, "PersistentVolumeClaim")
        assert claims["stagemesh-videos"]["spec"]["accessModes"] == [mode], overlay


# --- recipes -----------------------------------------------------------------------------------


def _dns_target(address: str) -> tuple[str, int]:
    """(host, port) of a gRPC `dns:///host:port` target."""
    match = re.fullmatch(r"dns:///([a-z0-9.-]+):(\d+)", address)
    assert match, f"{address!r} is not a dns:/// target"
    return match.group(1), int(match.group(2))


def test_recipes_resolve_every_pod_of_the_stage_services(overlay: str, tmp_path: Path) -> None:
    (config_map,) = of_kind(overlay, "ConfigMap").values()
    recipes_file = tmp_path / "recipes.yaml"
    recipes_file.write_text(config_map["data"]["recipes.yaml"])
    recipes = load_recipes(recipes_file)
    services = of_kind(overlay, "Service")
    deployments = of_kind(overlay, "Deployment")
    used = set()
    for recipe in recipes.values():
        for stage, endpoint in recipe.stages.items():
            host, port = _dns_target(endpoint.address)
            service = services[host.split(".")[0]]
            namespace = service["metadata"]["namespace"]
            name = f"{recipe.name}-{stage}"
            assert host == f"stagemesh-{name}.{namespace}.svc.cluster.local"
            assert service["spec"]["clusterIP"] == "None"
            assert port == named(service["spec"]["ports"], "grpc")["port"]
            assert endpoint.metrics_port == named(service["spec"]["ports"], "metrics")["port"]
            # The Service selects the recipe's own stage Deployment, which runs the recipe's
            # model in the right role with the recipe's options.
            (deployment,) = [d for d in deployments.values()
                             if selects(service["spec"]["selector"], pod_labels(d))]
            used.add(deployment["metadata"]["name"])
            args = container(deployment, "stage")["args"]
            assert role(deployment) == stage, (recipe.name, stage)
            assert flag(args, "--model") == recipe.model, (recipe.name, stage)
            assert _stage_options(deployment) == endpoint.options, (recipe.name, stage)
    assert used == set(STAGES)


def _comparable(recipe: Recipe, drop: frozenset[str] = frozenset()) -> Recipe:
    """A recipe without what differs between meshes: its model folder, where each stage runs
    (address, metrics ports) and the option keys in `drop`."""
    stages = {name: dataclasses.replace(
        endpoint, address="", metrics_port=None, replica_metrics_ports=(),
        options={k: v for k, v in endpoint.options.items() if k not in drop})
        for name, endpoint in recipe.stages.items()}
    return dataclasses.replace(recipe, model="", stages=stages)


def test_the_cluster_serves_the_recipes_of_the_embedded_mesh(overlay: str, tmp_path: Path) -> None:
    """Every recipe of gateway/recipes/default.yaml, in its order (the first text-to-speech
    recipe is the default voice), with the same task, stages, options and defaults; the gpu
    overlay adds only where a stage computes (device, dtype)."""
    (config_map,) = of_kind(overlay, "ConfigMap").values()
    recipes_file = tmp_path / "recipes.yaml"
    recipes_file.write_text(config_map["data"]["recipes.yaml"])
    cluster, embedded = load_recipes(recipes_file), load_recipes(DEFAULT_RECIPES)
    assert list(cluster) == list(embedded)
    drop = frozenset(PLACEMENT_OPTIONS if overlay == "overlays/gpu" else ())
    for name, recipe in cluster.items():
        assert _comparable(recipe, drop) == _comparable(embedded[name]), name


# --- autoscaling -------------------------------------------------------------------------------


def test_no_autoscaler_needs_a_metric_nothing_serves(overlay: str) -> None:
    """Stages scale through KEDA; the one HPA left (the gateway's) reads only CPU, which
    metrics-server serves. An HPA naming a Pods or External metric would need an adapter."""
    hpas = of_kind(overlay, "HorizontalPodAutoscaler")
    assert set(hpas) == {"gateway"}
    for metric in hpas["gateway"]["spec"]["metrics"]:
        assert (metric["type"], metric["resource"]["name"]) == ("Resource", "cpu")
    target = hpas["gateway"]["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "gateway")


def test_every_stage_scales_on_its_own_queue(overlay: str) -> None:
    scaled = of_kind(overlay, "ScaledObject")
    assert set(scaled) == set(ALL_STAGES)
    deployments = stage_deployments(overlay)
    exported = _exported_metric_names()
    for stage, scaled_object in scaled.items():
        spec = scaled_object["spec"]
        target = spec["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", stage)
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"], stage
        (trigger,) = spec["triggers"]
        assert (trigger["type"], trigger["metricType"]) == ("prometheus", "AverageValue")
        metadata = trigger["metadata"]
        assert PROMETHEUS_TRIGGER_REQUIRED <= set(metadata) <= PROMETHEUS_TRIGGER_KEYS, stage
        assert float(metadata["threshold"]) > 0
        names, labels = _query_selector(metadata["query"])
        # The selector picks exactly the queue gauges among everything a stage exports.
        assert {name for name in exported if names.fullmatch(name)} == QUEUE_METRICS, stage
        assert labels["namespace"].fullmatch(scaled_object["metadata"]["namespace"])
        engines = PIPER_CODEC_LABELS if stage == "piper-joe-codec" else \
            ENGINE_LABELS[role(deployments[stage])]
        assert {label for label in _all_engine_labels() if labels["stage"].fullmatch(label)} \
            == engines, stage
        # Only this Deployment's pods: another recipe's stage of the same role has its own.
        assert {other for other in deployments if labels["pod"].fullmatch(pod_name(other))} \
            == {stage}, stage
        assert not labels["pod"].fullmatch(f"{stage}-x-5d8f7b9c4-x7k2p"), stage


def test_stage_autoscalers_share_one_prometheus_and_scaling_pace(overlay: str) -> None:
    specs = [s["spec"] for s in of_kind(overlay, "ScaledObject").values()]
    assert len({s["triggers"][0]["metadata"]["serverAddress"] for s in specs}) == 1
    for spec in specs:
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleUp"]["stabilizationWindowSeconds"] == 0
        # Down slower than up: a pod removed costs a model load to get back.
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 60
        # Prometheus unreadable: hold the replicas there are, never drop to a static count.
        assert spec["fallback"]["behavior"] == "currentReplicas"


def test_cpu_tiny_keeps_its_autoscalers_with_small_bounds() -> None:
    for name, scaled_object in of_kind("overlays/cpu-tiny", "ScaledObject").items():
        spec = scaled_object["spec"]
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 2), name
    gateway = of_kind("overlays/cpu-tiny", "HorizontalPodAutoscaler")["gateway"]["spec"]
    assert (gateway["minReplicas"], gateway["maxReplicas"]) == (1, 2)
    # Replica counts belong to the autoscalers: a Deployment's own count would fight them on
    # every `kubectl apply`.
    for name, deployment in of_kind("overlays/cpu-tiny", "Deployment").items():
        assert "replicas" not in deployment["spec"], name
    # models are built into each pod; only the video store is a claim
    assert list(of_kind("overlays/cpu-tiny", "PersistentVolumeClaim")) == ["stagemesh-videos"]


def _exported_metric_names() -> set[str]:
    """Every sample name a stage engine exports, read from a real registry."""
    registry = CollectorRegistry()
    EngineMetrics("dit", registry=registry).observe_queues(3, 1)
    return {sample.name for family in registry.collect() for sample in family.samples}


def _all_engine_labels() -> set[str]:
    return {label for labels in ENGINE_LABELS.values() for label in labels}


def _query_selector(query: str) -> tuple[re.Pattern[str], dict[str, re.Pattern[str]]]:
    """The metric-name pattern and label patterns of the one selector in a PromQL query.

    Prometheus anchors regex matchers, hence the patterns are matched with fullmatch."""
    (selector,) = re.findall(r"\{([^{}]*)\}", query)
    matchers: dict[str, re.Pattern[str]] = {}
    for label, op, value in re.findall(r'\s*([A-Za-z_]+)\s*(=~|=)\s*"([^"]*)"\s*,?', selector):
        matchers[label] = re.compile(value if op == "=~" else re.escape(value))
    return matchers.pop("__name__"), matchers


def test_the_query_parser_sees_through_a_wrong_metric() -> None:
    names, labels = _query_selector('sum({__name__=~"stagemesh_requests_queued", stage="dit"})')
    assert {n for n in _exported_metric_names() if names.fullmatch(n)} == set()
    assert labels["stage"].fullmatch("dit") and not labels["stage"].fullmatch("dit2")


# --- security ----------------------------------------------------------------------------------


def _secret_env(each: Doc, env_name: str) -> tuple[str, str]:
    ref = _env(each)[env_name]["valueFrom"]["secretKeyRef"]
    assert not ref.get("optional", False), env_name
    return ref["name"], ref["key"]


def test_the_mesh_credential_and_api_keys_come_from_secrets(overlay: str) -> None:
    env_name, secret, key = MESH_TOKEN
    for name, deployment in stage_deployments(overlay).items():
        stage_container = container(deployment, "stage")
        assert _secret_env(stage_container, env_name) == (secret, key), name
        # A stage never sees the clients' API keys.
        assert API_KEYS[0] not in _env(stage_container), name
    gateway = container(of_kind(overlay, "Deployment")["gateway"], "gateway")
    assert _secret_env(gateway, env_name) == (secret, key)
    assert _secret_env(gateway, API_KEYS[0]) == API_KEYS[1:]
    # No secret value is in git: the Secrets are made in the cluster (k8s/README.md).
    assert of_kind(overlay, "Secret") == {}


def _ingress_allowed(overlay: str, target: Mapping[str, str], port_name: str,
                     peer: Mapping[str, str], peer_namespace: Mapping[str, str]) -> bool:
    """Whether the NetworkPolicies let a pod with labels `peer`, in a namespace with labels
    `peer_namespace`, connect to the named port of a pod with labels `target` (all in the
    policies' namespace unless peer_namespace says otherwise)."""
    policies = [p["spec"] for p in of_kind(overlay, "NetworkPolicy").values()
                if "Ingress" in p["spec"]["policyTypes"]
                and selects(p["spec"]["podSelector"], target)]
    if not policies:
        return True  # a pod no policy selects is open
    same_namespace = peer_namespace.get("kubernetes.io/metadata.name") == "stagemesh"
    for spec in policies:
        for rule in spec.get("ingress", []):
            ports = [p["port"] for p in rule.get("ports", [])]
            if ports and port_name not in ports:
                continue
            peers = rule.get("from")
            if peers is None:
                return True
            for each in peers:
                namespace_ok = (selects(each["namespaceSelector"], peer_namespace)
                                if "namespaceSelector" in each else same_namespace)
                pod_ok = selects(each["podSelector"], peer) if "podSelector" in each else True
                if namespace_ok and pod_ok:
                    return True
    return False


def test_network_policy_lets_only_gateways_and_prometheus_reach_stages(overlay: str) -> None:
    gateway = pod_labels(of_kind(overlay, "Deployment")["gateway"])
    here = {"kubernetes.io/metadata.name": "stagemesh"}
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    elsewhere = {"kubernetes.io/metadata.name": "default"}
    stages = stage_deployments(overlay)
    for name, deployment in stages.items():
        stage = pod_labels(deployment)
        other_stage = pod_labels(next(d for n, d in stages.items() if n != name))
        assert _ingress_allowed(overlay, stage, "grpc", gateway, here), name
        assert _ingress_allowed(overlay, stage, "metrics", {}, monitoring), name
        assert not _ingress_allowed(overlay, stage, "metrics", gateway, here), name
        assert not _ingress_allowed(overlay, stage, "grpc", {}, monitoring), name
        assert not _ingress_allowed(overlay, stage, "grpc", other_stage, here), name
        assert not _ingress_allowed(overlay, stage, "grpc", gateway, elsewhere), name
        assert not _ingress_allowed(overlay, stage, "grpc", {"app": "debug"}, here), name
    # The gateway is the public entry: reachable on its API ports, from anywhere.
    for port in ("http", "grpc"):
        assert _ingress_allowed(overlay, gateway, port, {}, elsewhere), port


# --- overlays ----------------------------------------------------------------------------------


def _expanded_args(each: Doc, labels: Mapping[str, str]) -> list[str]:
    """A container's args as the kubelet runs them: $(VAR) replaced by the env variable, here
    one read from a pod label (the downward API)."""
    values = {}
    for env in each.get("env", []):
        field_path = env["valueFrom"]["fieldRef"]["fieldPath"]
        match = re.fullmatch(r"metadata\.labels\['([^']+)'\]", field_path)
        assert match, field_path
        values[env["name"]] = labels[match.group(1)]
    return [re.sub(r"\$\(([A-Z_]+)\)", lambda m: values[m.group(1)], arg) for arg in each["args"]]


def test_cpu_tiny_builds_each_stage_model_where_the_stage_reads_it() -> None:
    for stage, deployment in stage_deployments("overlays/cpu-tiny").items():
        pod = deployment["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        spec, target = _expanded_args(init, pod_labels(deployment))
        # The folder's name is the built-in model's: builtin:<name> -> /models/<name>.
        assert spec == "builtin:" + Path(target).name, stage
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


#: overlays/gpu-parallel: the gpu overlay with this DiT as one group of ranks in one pod.
GROUP_DIT = "tiny-shapes-video-dit"


def test_gpu_parallel_overlay_gives_a_group_one_pod_with_a_gpu_per_rank() -> None:
    """One Deployment per group: the DiT's pod holds parallel_cfg x parallel_ulysses GPUs and a
    memory-backed /dev/shm (NCCL between the pod's GPUs); KEDA scales that Deployment, so the
    scaling unit is the group; everything else is the gpu overlay, validated as strictly."""
    overlay, gpu = "overlays/gpu-parallel", "overlays/gpu"
    errors = [e for doc in render(overlay) for e in validator().resource_errors(doc, "1.32.0")]
    assert not errors, errors
    dit = of_kind(overlay, "Deployment")[GROUP_DIT]
    options = _stage_options(dit)
    cfg, ulysses = options.pop("parallel_cfg"), options.pop("parallel_ulysses")
    assert isinstance(cfg, int) and isinstance(ulysses, int) and cfg * ulysses > 1
    assert options == _stage_options(of_kind(gpu, "Deployment")[GROUP_DIT])
    resources = container(dit, "stage")["resources"]
    gpus = {resources[kind]["nvidia.com/gpu"] for kind in ("requests", "limits")}
    assert gpus == {str(cfg * ulysses)}
    pod = dit["spec"]["template"]["spec"]
    assert named(pod["volumes"], "dshm")["emptyDir"]["medium"] == "Memory"
    assert named(container(dit, "stage")["volumeMounts"], "dshm")["mountPath"] == "/dev/shm"
    scaled = of_kind(overlay, "ScaledObject")[GROUP_DIT]
    assert scaled["spec"]["scaleTargetRef"]["name"] == GROUP_DIT
    others = [doc for doc in render(overlay) if doc["metadata"]["name"] != GROUP_DIT
              or doc["kind"] != "Deployment"]
    assert others == [doc for doc in render(gpu) if doc["metadata"]["name"] != GROUP_DIT
                      or doc["kind"] != "Deployment"]


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
    for name, deployment in stage_deployments("overlays/gpu").items():
        options = _stage_options(deployment)
        if name in GPU_STAGES:
            assert (options["device"], options["dtype"]) == ("cuda", "bfloat16"), name
        elif name in ONNX_STAGES:
            assert not PLACEMENT_OPTIONS & set(options), name  # ONNX Runtime's CPU provider
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
