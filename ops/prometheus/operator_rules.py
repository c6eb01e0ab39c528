"""Writes ops/k8s/alerts.yaml: every alert rule of ops/prometheus (the workers' alerts.yml, the gateway's gateway.yml,
Redis' redis.yml) as one PrometheusRule for the Prometheus Operator.

    python ops/prometheus/operator_rules.py      # after changing a rule file; a test keeps them equal
    python ops/prometheus/operator_rules.py --runbook-base https://git.example.com/decision-queue/blob/main/

Each rule's ``runbook_url`` is a section of docs/OPERATIONS.md, as a path in this repository; ``--runbook-base``
puts where your copy of the docs is published in front of it (the committed file keeps the path).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

OPS = Path(__file__).resolve().parents[1]
OUT = OPS / "k8s" / "alerts.yaml"
RULE_FILES = ("alerts.yml", "gateway.yml", "redis.yml")
HEADER = """\
# Generated from ops/prometheus/alerts.yml, gateway.yml and redis.yml by python ops/prometheus/operator_rules.py: edit
# those, not this. The alert rules for the Prometheus Operator. Its Prometheus picks a PrometheusRule by its
# ruleSelector (often the label release: <the Helm release>): add that label here if yours selects on one.
"""


def render(runbook_base: str = "") -> str:
    groups = [group for name in RULE_FILES
              for group in yaml.safe_load((OPS / "prometheus" / name).read_text())["groups"]]
    for group in groups:
        for rule in group["rules"]:
            rule["annotations"]["runbook_url"] = runbook_base + rule["annotations"]["runbook_url"]
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "decision-queue", "labels": {"app.kubernetes.io/name": "decision-queue"}},
            "spec": {"groups": groups}}
    return HEADER + yaml.safe_dump(rule, sort_keys=False, width=120)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runbook-base", default="", help="put in front of each runbook_url (docs/OPERATIONS.md#...)")
    parser.add_argument("--out", default=str(OUT), help=f"where to write [default {OUT.relative_to(OPS.parent)}]")
    args = parser.parse_args()
    Path(args.out).write_text(render(args.runbook_base))
    print(f"wrote {args.out}", file=sys.stderr)
