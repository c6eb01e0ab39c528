"""The Kubernetes manifests as kubectl renders them (``kubectl kustomize``; the files themselves without kubectl):
KEDA owns the worker count, the autoscaler's known failure modes are covered, and everything a pod mounts exists."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

OPS = Path(__file__).resolve().parents[2] / "ops"
K8S = OPS / "k8s"
# Components and overlays need kustomize itself; the rest falls back to reading the listed files.
needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl to render the kustomization")


def render(path: Path = K8S) -> list[dict]:
    """The documents ``kubectl apply -k`` would send (kubectl kustomize), or the listed files without kubectl."""
    if shutil.which("kubectl"):
        done = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    docs = []
    for resource in yaml.safe_load((path / "kustomization.yaml").read_text())["resources"]:
        if (path / resource).is_file():
            docs += [doc for doc in yaml.safe_load_all((path / resource).read_text()) if doc]
    return docs


def by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def test_no_scaled_workload_pins_its_replicas():
    """A replicas field on a workload KEDA scales resets the fleet to it on every kubectl apply."""
    docs = render()
    scaled = by_kind(docs, "ScaledObject")
    assert scaled
    for name, scaled_object in scaled.items():
        target = scaled_object["spec"]["scaleTargetRef"]
        workload = by_kind(docs, target.get("kind", "Deployment"))[target["name"]]
        assert "replicas" not in workload["spec"], f"{target['name']} pins replicas while {name} scales it"


def test_the_autoscaler_never_waits_on_activation_and_bounds_a_failing_trigger():
    for name, scaled_object in by_kind(render(), "ScaledObject").items():
        spec = scaled_object["spec"]
        # From zero, KEDA needs lag > activationLagCount to activate, and some releases refuse 0 (keda#6478): a
        # lone request would wait for a second one. A warm worker also keeps the streams and group in existence.
        assert spec["minReplicaCount"] >= 1, name
        # A trigger that errors (a missing stream or group, keda#7447; Redis down) falls back to a fixed count
        # within the bounds, never an unbounded one.
        fallback = spec["fallback"]
        assert fallback["failureThreshold"] >= 1
        assert spec["minReplicaCount"] <= fallback["replicas"] <= spec["maxReplicaCount"]
        # fallback needs AverageValue targets (the redis-streams default): no trigger may say otherwise
        assert all(t.get("metricType", "AverageValue") == "AverageValue" for t in spec["triggers"]), name


def switched_on(tmp_path: Path, *lines: str) -> Path:
    """A copy of ops/k8s with these commented lines of kustomization.yaml switched on (as its comments say)."""
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    text = (copy / "kustomization.yaml").read_text()
    for line in lines:
        assert f"# {line}\n" in text, line
        text = text.replace(f"# {line}\n", f"{line}\n")
    (copy / "kustomization.yaml").write_text(text)
    return copy


def with_monitoring(tmp_path: Path) -> Path:
    return switched_on(tmp_path, "- monitoring.yaml", "- alerts.yaml")


def test_every_claim_a_pod_mounts_is_defined():
    docs = render()
    claims = by_kind(docs, "PersistentVolumeClaim")
    for kind in ("Deployment", "StatefulSet"):
        for name, workload in by_kind(docs, kind).items():
            for volume in workload["spec"]["template"]["spec"].get("volumes", []):
                claim = volume.get("persistentVolumeClaim")
                if claim:
                    assert claim["claimName"] in claims, f"{name} mounts the undefined claim {claim['claimName']}"


@needs_kubectl
def test_the_checkpoint_comes_from_an_image_by_default_or_from_a_claim_many_nodes_can_mount(tmp_path):
    pod = by_kind(render(), "Deployment")["dq-worker"]["spec"]["template"]["spec"]
    [init] = pod["initContainers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes["models"] and "emptyDir" in volumes["compile-cache"]  # schedules anywhere
    assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]
    docs = render(switched_on(tmp_path, "components:", "  - components/models-pvc",
                              "  - components/shared-compile-cache"))
    pod = by_kind(docs, "Deployment")["dq-worker"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "initContainers" not in pod or pod["initContainers"] == []
    assert volumes["models"] == {"name": "models", "persistentVolumeClaim": {"claimName": "dq-models",
                                                                               "readOnly": True}}
    assert volumes["compile-cache"] == {"name": "compile-cache",
                                        "persistentVolumeClaim": {"claimName": "dq-compile-cache"}}
    claims = by_kind(docs, "PersistentVolumeClaim")
    assert claims["dq-models"]["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert claims["dq-compile-cache"]["spec"]["accessModes"] == ["ReadWriteMany"]
    for name, workload in by_kind(docs, "Deployment").items():  # what a component mounts, it defines
        for volume in workload["spec"]["template"]["spec"].get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, name




def test_the_operator_gets_every_alert_rule_and_scrapes_every_part(tmp_path):
    """Workers, the queue exporter, the gateway and Redis' exporter each have a PodMonitor on a port their pod
    names, and the PrometheusRule carries the rules of every rule file (the gateway's and Redis' included)."""
    sys.path.insert(0, str(OPS / "prometheus"))
    import operator_rules

    assert (K8S / "alerts.yaml").read_text() == operator_rules.render(), "python ops/prometheus/operator_rules.py"
    docs = render(with_monitoring(tmp_path))
    [rule] = by_kind(docs, "PrometheusRule").values()
    alerts = {r["alert"] for group in rule["spec"]["groups"] for r in group["rules"]}
    assert {"DecisionQueueWorkerDown", "DecisionQueueNoReadyWorker", "DecisionQueueLagWithoutWorkers",
            "DecisionQueueGatewayDown", "DecisionQueueGatewayUnavailable", "DecisionQueueGatewayTimeouts",
            "DecisionQueueRedisMemoryFull", "DecisionQueueRedisEvicting"} <= alerts
    deployments = by_kind(docs, "Deployment")
    monitors = by_kind(docs, "PodMonitor")
    for name in ("dq-worker", "dq-exporter", "dq-gateway", "dq-redis-exporter"):
        labels = deployments[name]["spec"]["template"]["metadata"]["labels"]
        [monitor] = [m for m in monitors.values()
                     if m["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
        [container] = deployments[name]["spec"]["template"]["spec"]["containers"]
        assert port in {p["name"] for p in container["ports"]}, name


def pods(docs: list[dict]) -> dict[str, dict]:
    """Every pod template of the rendered workloads, by workload name."""
    return {doc["metadata"]["name"]: doc["spec"]["template"]["spec"] for doc in docs
            if doc["kind"] in ("Deployment", "StatefulSet", "Job")}


def secrets_used(pod: dict) -> set[str]:
    used = {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
    for container in pod.get("initContainers", []) + pod["containers"]:
        used |= {e["valueFrom"]["secretKeyRef"]["name"] for e in container.get("env", [])
                 if "secretKeyRef" in e.get("valueFrom", {})}
    return used


def test_a_job_loads_the_function_library_as_the_admin_user():
    """Least-privilege workers cannot load the library or create the streams: the Job does, as admin, with the
    worker image and the deployment's namespace and shards."""
    docs = render()
    job = by_kind(docs, "Job")["dq-load-functions"]
    [container] = job["spec"]["template"]["spec"]["containers"]
    worker = by_kind(docs, "Deployment")["dq-worker"]["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["load-functions"] and container["image"] == worker["image"]
    env = {e["name"]: e for e in container["env"]}
    assert env["DQ_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "dq-redis-admin", "key": "url"}
    assert env["DQ_NAMESPACE"]["valueFrom"]["configMapKeyRef"]["key"] == "DQ_NAMESPACE" and "DQ_SHARDS" in env
    assert job["spec"]["template"]["spec"]["restartPolicy"] in ("OnFailure", "Never")
    example = {d["metadata"]["name"]: d for d in yaml.safe_load_all((K8S / "secret.example.yaml").read_text()) if d}
    assert example["dq-redis-admin"]["stringData"]["url"].startswith("redis://admin:")


@needs_kubectl
def test_it_schedules_without_a_tls_secret_and_the_tls_component_mounts_the_ca_everywhere(tmp_path):
    """By default no pod needs the dq-redis-tls secret (a cluster whose Redis has no TLS schedules everything);
    with components/redis-tls every pod that talks to Redis mounts the CA where its CA setting points, and KEDA's
    trigger logs in over TLS. Every secret a pod reads is in secret.example.yaml either way."""
    example = {d["metadata"]["name"] for d in yaml.safe_load_all((K8S / "secret.example.yaml").read_text()) if d}
    plain = render()
    for name, pod in pods(plain).items():
        assert "dq-redis-tls" not in secrets_used(pod) and secrets_used(pod) <= example, name
    [auth] = by_kind(plain, "TriggerAuthentication").values()
    assert {r["parameter"] for r in auth["spec"]["secretTargetRef"]} == {"username", "password"}
    tls = render(switched_on(tmp_path, "components:", "  - components/redis-tls"))
    talk_to_redis = {"dq-worker", "dq-gateway", "dq-exporter", "dq-load-functions", "dq-redis-exporter"}
    assert talk_to_redis <= set(pods(tls))
    config = by_kind(tls, "ConfigMap")["dq-worker"]["data"]
    for name in talk_to_redis:
        pod = pods(tls)[name]
        assert "dq-redis-tls" in secrets_used(pod) and secrets_used(pod) <= example, name
        [container] = pod["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        ca = env.get("DQ_REDIS_TLS_CA") or env.get("REDIS_EXPORTER_TLS_CA_CERT_FILE") or config.get("DQ_REDIS_TLS_CA")
        assert ca and str(Path(ca).parent) in {m["mountPath"] for m in container["volumeMounts"]}, name
    assert pods(tls)["dq-redis-exporter"]["containers"][0]["env"][0]["value"].startswith("rediss://")
    [auth] = by_kind(tls, "TriggerAuthentication").values()
    assert {r["parameter"] for r in auth["spec"]["secretTargetRef"]} == {"username", "password", "tls", "ca"}


@needs_kubectl
def test_the_projects_images_come_from_your_registry_through_the_images_transformer():
    """Every image the project builds is named without registry or tag in the manifests, and the kustomization's
    images: entry gives both (one place to point at your registry)."""
    entries = {i["name"]: i for i in yaml.safe_load((K8S / "kustomization.yaml").read_text())["images"]}
    assert set(entries) == {"decision-queue-worker", "decision-queue-gateway", "decision-queue-model"}
    images = {c["image"] for pod in pods(render()).values() for c in pod.get("initContainers", []) + pod["containers"]}
    ours = {image for image in images if "decision-queue-" in image}
    assert ours == {f"{e['newName']}:{e['newTag']}" for e in entries.values()}
    assert all(image.startswith("registry.example.com/") for image in ours)


def test_the_exporter_reads_the_queue_as_the_monitor_user():
    docs = render()
    exporter = by_kind(docs, "Deployment")["dq-exporter"]
    [container] = exporter["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["dq-producer"] and container["args"][0] == "exporter"
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    env = {e["name"]: e for e in container["env"]}
    assert env["DQ_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "dq-redis-monitor", "key": "url"}
    example = [d for d in yaml.safe_load_all((K8S / "secret.example.yaml").read_text())
               if d["metadata"]["name"] == "dq-redis-monitor"][0]
    assert example["stringData"]["url"].startswith("redis://monitor:")  # rediss:// with components/redis-tls


@needs_kubectl
def test_rendering_needs_kubectl_only():
    assert {"Deployment", "ScaledObject", "TriggerAuthentication"} <= {d["kind"] for d in render()}


@needs_kubectl
def test_each_extra_shard_is_an_overlay_of_the_base_for_its_own_streams(tmp_path):
    sys.path.insert(0, str(K8S))
    import shards

    from producer.wire.keys import LANES, Keys

    overlay = OPS / "k8s-shards" / "s1" / "kustomization.yaml"
    assert overlay.read_text() == shards.overlay(1), "python ops/k8s/shards.py COUNT"
    copy = tmp_path / "ops"  # with monitoring on in the base: the overlay must not repeat what shards share
    shutil.copytree(OPS / "k8s-shards", copy / "k8s-shards")
    monitored = switched_on(tmp_path, "- monitoring.yaml", "- alerts.yaml")
    shutil.move(str(monitored), copy / "k8s")
    docs = render(copy / "k8s-shards" / "s1")
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("ConfigMap", "dq-worker-s1"), ("Deployment", "dq-worker-s1"), ("PodDisruptionBudget", "dq-worker-s1"),
        ("ScaledObject", "dq-worker-s1")]
    deployment = by_kind(docs, "Deployment")["dq-worker-s1"]
    assert "replicas" not in deployment["spec"]
    pod = deployment["spec"]["template"]
    assert pod["spec"]["containers"][0]["envFrom"] == [{"configMapRef": {"name": "dq-worker-s1"}}]
    assert by_kind(docs, "ConfigMap")["dq-worker-s1"]["data"]["DQ_SHARD"] == "1"
    # its selector is its own: shard 0's pods (no shard label) are never shard 1's
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector["decision-queue/shard"] == "1" and selector.items() <= pod["metadata"]["labels"].items()
    base_pod = by_kind(render(), "Deployment")["dq-worker"]["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= base_pod.items()
    assert by_kind(docs, "PodDisruptionBudget")["dq-worker-s1"]["spec"]["selector"]["matchLabels"] == selector
    scaled = by_kind(docs, "ScaledObject")["dq-worker-s1"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "dq-worker-s1"
    keys = Keys("dq", 1)
    assert {t["metadata"]["stream"] for t in scaled["spec"]["triggers"]} == {
        stream for lane in LANES for stream in (keys.requests_in(lane), keys.parts_in(lane))}
    assert {t["authenticationRef"]["name"] for t in scaled["spec"]["triggers"]} == {"dq-redis-monitor"}  # shared


@needs_kubectl
def test_a_second_model_is_an_overlay_of_the_base_for_its_own_namespace(tmp_path):
    sys.path.insert(0, str(K8S))
    import models

    from producer.wire.keys import LANES, Keys

    overlay = OPS / "k8s-models" / "decider-b" / "kustomization.yaml"
    assert overlay.read_text() == models.overlay("decider-b", "dq-b", "REGISTRY/decider-b-model:0.1.0"), \
        "python ops/k8s/models.py decider-b --namespace dq-b --image REGISTRY/decider-b-model:0.1.0"
    copy = tmp_path / "ops"  # with monitoring on in the base: the overlay must not repeat what models share
    shutil.copytree(OPS / "k8s-models", copy / "k8s-models")
    shutil.move(str(switched_on(tmp_path, "- monitoring.yaml", "- alerts.yaml")), copy / "k8s")
    docs = render(copy / "k8s-models" / "decider-b")
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == [
        ("ConfigMap", "dq-worker-decider-b"), ("Deployment", "dq-exporter-decider-b"),
        ("Deployment", "dq-worker-decider-b"), ("Job", "dq-load-functions-decider-b"),
        ("PodDisruptionBudget", "dq-worker-decider-b"), ("ScaledObject", "dq-worker-decider-b")]
    config = by_kind(docs, "ConfigMap")["dq-worker-decider-b"]["data"]
    assert (config["DQ_NAMESPACE"], config["DQ_SERVED_MODEL_NAME"]) == ("dq-b", "decider-b")
    worker = by_kind(docs, "Deployment")["dq-worker-decider-b"]["spec"]
    assert worker["template"]["spec"]["initContainers"][0]["image"] == "REGISTRY/decider-b-model:0.1.0"
    assert worker["selector"]["matchLabels"]["decision-queue/model"] == "decider-b"
    exporter = by_kind(docs, "Deployment")["dq-exporter-decider-b"]["spec"]["template"]["spec"]["containers"][0]
    [namespace] = [e for e in exporter["env"] if e["name"] == "DQ_NAMESPACE"]
    assert namespace["valueFrom"]["configMapKeyRef"]["name"] == "dq-worker-decider-b"  # it reads the model's queue
    setup = by_kind(docs, "Job")["dq-load-functions-decider-b"]["spec"]["template"]["spec"]["containers"][0]
    [namespace] = [e for e in setup["env"] if e["name"] == "DQ_NAMESPACE"]
    assert namespace["valueFrom"]["configMapKeyRef"]["name"] == "dq-worker-decider-b"  # its streams made first
    scaled = by_kind(docs, "ScaledObject")["dq-worker-decider-b"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "dq-worker-decider-b"
    keys = Keys("dq-b", 0)
    assert {t["metadata"]["stream"] for t in scaled["spec"]["triggers"]} == {
        stream for lane in LANES for stream in (keys.requests_in(lane), keys.parts_in(lane))}
