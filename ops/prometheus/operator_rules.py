"""Writes ops/k8s/alerts.yaml: the alert rules of alerts.yml as a PrometheusRule for the Prometheus Operator.

    python ops/prometheus/operator_rules.py      # after changing alerts.yml; a test keeps the two equal
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

OPS = Path(__file__).resolve().parents[1]
OUT = OPS / "k8s" / "alerts.yaml"
HEADER = """\
# Generated from ops/prometheus/alerts.yml by python ops/prometheus/operator_rules.py: edit those, not this.
# The alert rules for the Prometheus Operator. Its Prometheus picks a PrometheusRule by its ruleSelector (often the
# label release: <the Helm release>): add that label here if yours selects on one.
"""


def render() -> str:
    groups = yaml.safe_load((OPS / "prometheus" / "alerts.yml").read_text())["groups"]
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "decision-queue", "labels": {"app.kubernetes.io/name": "decision-queue"}},
            "spec": {"groups": groups}}
    return HEADER + yaml.safe_dump(rule, sort_keys=False, width=120)


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
