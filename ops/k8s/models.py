"""Writes one kustomize overlay per extra model: ops/k8s-models/<NAME>/kustomization.yaml. A model is a namespace
of the queue (its own streams, lanes and workers; docs/OPERATIONS.md, "Several models"), so each overlay is the
base's workers for that namespace: the Deployment, ScaledObject, ConfigMap, PodDisruptionBudget, the queue exporter
and the set-up Job (it creates the namespace's streams and group before KEDA reads them) renamed with -<NAME>,
labelled with the model (selectors included), DQ_NAMESPACE, DQ_SERVED_MODEL_NAME and the KEDA streams set to it, the
checkpoint from the model's own image; what all models share (the Kubernetes namespace, KEDA's
TriggerAuthentication, the gateway, Redis' exporter, monitoring) stays in the base only.

    python ops/k8s/models.py decider-b --namespace dq-b --image REGISTRY/decider-b-model:1
    kubectl apply -k ops/k8s && kubectl apply -k ops/k8s-models/decider-b

The gateway routes a System One call to the model it names once its keys may use the model's namespace
(``model_namespaces`` in the keys file, or DQ_GATEWAY_MODEL_NAMESPACES; docs/GATEWAY.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parent
sys.path.insert(0, str(K8S))
sys.path.insert(0, str(K8S.parents[1]))

from shards import _Literal  # noqa: E402

from producer.wire.keys import LANES, MODEL_NAME, NAMESPACE_PATTERN, Keys  # noqa: E402

SHARED = [("Namespace", None), ("TriggerAuthentication", None), ("PodMonitor", None), ("PrometheusRule", None),
          ("Deployment", "dq-redis-exporter"),  # Redis itself, watched once
          ("Deployment", "dq-gateway"), ("Service", "dq-gateway"), ("HorizontalPodAutoscaler", "dq-gateway"),
          ("PodDisruptionBudget", "dq-gateway")]  # the gateway routes to every model
MODEL_IMAGE = "decision-queue-model"  # the base's checkpoint image (worker.yaml's init container)


def overlay(name: str, namespace: str, image: str) -> str:
    """The kustomization.yaml of one model's overlay (its label and suffix: ``name`` made a Kubernetes name)."""
    label = name.replace("/", "-").replace("@", "-").replace(":", "-").replace("+", "-").lower()
    config = yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]
    scaled = next(d for d in yaml.safe_load_all((K8S / "keda.yaml").read_text()) if d["kind"] == "ScaledObject")
    shard = int(config["DQ_SHARD"])
    base, mine = Keys(config["DQ_NAMESPACE"], shard), Keys(namespace, shard)
    rename = {base.requests_in(lane): mine.requests_in(lane) for lane in LANES}
    rename |= {base.parts_in(lane): mine.parts_in(lane) for lane in LANES}
    streams = [{"op": "replace", "path": f"/spec/triggers/{i}/metadata/stream",
                "value": rename[t["metadata"]["stream"]]} for i, t in enumerate(scaled["spec"]["triggers"])]
    patches = []
    for kind, shared in SHARED:
        target = {"kind": kind, **({"name": shared} if shared else {})}
        patches.append({"target": target, "patch": yaml.safe_dump(
            {"$patch": "delete", "apiVersion": "v1", "kind": kind, "metadata": {"name": shared or "any"}})})
    patches += [
        {"target": {"kind": "ConfigMap", "name": "dq-worker"}, "patch": yaml.safe_dump([
            {"op": "replace", "path": "/data/DQ_NAMESPACE", "value": namespace},
            {"op": "replace", "path": "/data/DQ_SERVED_MODEL_NAME", "value": name}])},
        {"target": {"kind": "ScaledObject", "name": "dq-worker"},
         "patch": yaml.safe_dump([{"op": "replace", "path": "/spec/scaleTargetRef/name",
                                   "value": f"{scaled['spec']['scaleTargetRef']['name']}-{label}"}, *streams])}]
    new_name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
    # The base names its images already (kustomization.yaml, images): the overlay renames what the base made.
    named = yaml.safe_load((K8S / "kustomization.yaml").read_text()).get("images") or []
    model_image = next((i.get("newName", MODEL_IMAGE) for i in named if i["name"] == MODEL_IMAGE), MODEL_IMAGE)
    document = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                "resources": ["../../k8s"], "nameSuffix": f"-{label}",
                "labels": [{"pairs": {"decision-queue/model": label}, "includeSelectors": True,
                            "includeTemplates": True}],
                "images": [{"name": model_image, "newName": new_name, **({"newTag": tag} if tag else {})}],
                "patches": patches}
    header = (f"# The model {name}'s workers (namespace {namespace}), written by python ops/k8s/models.py: edit that, "
              f"not this.\n#   kubectl apply -k ops/k8s-models/{label}     (after kubectl apply -k ops/k8s)\n")
    return header + yaml.dump(document, Dumper=_Literal, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="the model's served name (DQ_SERVED_MODEL_NAME): what System One calls send")
    parser.add_argument("--namespace", required=True, help="its queue's namespace (DQ_NAMESPACE), the base's not")
    parser.add_argument("--image", required=True, help="the image holding its checkpoint (ops/Dockerfile.model)")
    args = parser.parse_args(argv)
    base = yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]["DQ_NAMESPACE"]
    if not MODEL_NAME.match(args.name) or not NAMESPACE_PATTERN.match(args.namespace) or args.namespace == base:
        parser.error(f"a model name and a namespace of its own (not the base's {base}) are needed")
    text = overlay(args.name, args.namespace, args.image)
    path = K8S.parent / "k8s-models" / text.split("ops/k8s-models/")[1].split()[0] / "kustomization.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path.relative_to(K8S.parents[1])}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
