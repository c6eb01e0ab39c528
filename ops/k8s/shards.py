"""Writes one kustomize overlay per extra stream shard: ops/k8s-shards/s<N>/kustomization.yaml, for shards 1 to
COUNT - 1 (shard 0 is ops/k8s itself; kustomize refuses an overlay inside its base's directory). Each overlay is the base's worker for its shard: the Deployment,
ScaledObject, ConfigMap and PodDisruptionBudget renamed with -s<N>, labelled with the shard (selectors included),
DQ_SHARD and the KEDA streams set to it; what all shards share (the namespace, KEDA's TriggerAuthentication, the
exporters, the load-functions Job, the gateway, monitoring) stays in the base only.

    python ops/k8s/shards.py 4             # shards 1, 2 and 3
    kubectl apply -k ops/k8s && kubectl apply -k ops/k8s-shards/s1 ...

Producers and the exporter must know the count: DQ_SHARDS=4 (exporter.yaml sets it for the exporter).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parent
sys.path.insert(0, str(K8S.parents[1]))

from producer.wire.keys import Keys  # noqa: E402

SHARED = [("Namespace", None), ("TriggerAuthentication", None), ("Deployment", "dq-exporter"), ("PodMonitor", None),
          ("Job", "dq-load-functions"), ("Deployment", "dq-redis-exporter"),
          ("PrometheusRule", None), ("Deployment", "dq-gateway"), ("Service", "dq-gateway"),
          ("HorizontalPodAutoscaler", "dq-gateway"), ("PodDisruptionBudget", "dq-gateway")]  # gateways serve every shard


def overlay(shard: int) -> str:
    """The kustomization.yaml of one shard's overlay."""
    config = yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]
    scaled = next(d for d in yaml.safe_load_all((K8S / "keda.yaml").read_text()) if d["kind"] == "ScaledObject")
    base, mine = Keys(config["DQ_NAMESPACE"], 0), Keys(config["DQ_NAMESPACE"], shard)
    rename = {base.requests_in(lane): mine.requests_in(lane) for lane in ("high", "normal")}
    rename |= {base.parts_in(lane): mine.parts_in(lane) for lane in ("high", "normal")}
    streams = [{"op": "replace", "path": f"/spec/triggers/{i}/metadata/stream",
                "value": rename[t["metadata"]["stream"]]} for i, t in enumerate(scaled["spec"]["triggers"])]
    patches = []
    for kind, name in SHARED:  # a target selector: no error where the base does not have it (monitoring is optional)
        target = {"kind": kind, **({"name": name} if name else {})}
        patches.append({"target": target, "patch": yaml.safe_dump(
            {"$patch": "delete", "apiVersion": "v1", "kind": kind, "metadata": {"name": name or "any"}})})
    patches += [
        {"target": {"kind": "ConfigMap", "name": "dq-worker"},
         "patch": yaml.safe_dump([{"op": "replace", "path": "/data/DQ_SHARD", "value": str(shard)}])},
        # nameSuffix does not reach KEDA's reference to its target
        {"target": {"kind": "ScaledObject", "name": "dq-worker"},
         "patch": yaml.safe_dump([{"op": "replace", "path": "/spec/scaleTargetRef/name",
                                   "value": f"{scaled['spec']['scaleTargetRef']['name']}-s{shard}"}, *streams])}]
    document = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                "resources": ["../../k8s"], "nameSuffix": f"-s{shard}",
                "labels": [{"pairs": {"decision-queue/shard": str(shard)}, "includeSelectors": True,
                            "includeTemplates": True}],
                "patches": patches}
    header = (f"# Shard {shard}'s workers, written by python ops/k8s/shards.py: edit that, not this.\n"
              f"#   kubectl apply -k ops/k8s-shards/s{shard}     (after kubectl apply -k ops/k8s)\n")
    return header + yaml.dump(document, Dumper=_Literal, sort_keys=False, width=120)


class _Literal(yaml.SafeDumper):
    """Patches as readable blocks (|), not quoted strings with \\n."""


_Literal.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("count", type=int, help="how many shards the deployment has (at least 2)")
    args = parser.parse_args(argv)
    if args.count < 2:
        parser.error("a single shard is ops/k8s itself: give 2 or more")
    for shard in range(1, args.count):
        path = K8S.parent / "k8s-shards" / f"s{shard}" / "kustomization.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(overlay(shard))
        print(f"wrote {path.relative_to(K8S.parents[1])}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
