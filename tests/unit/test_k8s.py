"""The Kubernetes manifests as kubectl renders them (``kubectl kustomize``; the files themselves without kubectl):
KEDA owns the worker count, the autoscaler's known failure modes are covered, and everything a pod mounts exists."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "ops" / "k8s"


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


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl to render the kustomization")
def test_rendering_needs_kubectl_only():
    assert {"Deployment", "ScaledObject", "TriggerAuthentication"} <= {d["kind"] for d in render()}
