"""The gateway's deployment files agree with each other and with the gateway: compose, the image, Kubernetes,
Prometheus' job and the gateway's alerts (promtool runs their cases where installed), the dashboard's metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from producer.gateway.config import GatewayConfig, env_name, own_fields, parse_keys
from producer.gateway.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "ops"
VARIABLES = {env_name(f.name) for f in own_fields()} | {"DQ_REDIS_URL", "DQ_NAMESPACE", "DQ_REDIS_TLS_CA",
                                                         "DQ_SHARDS", "DQ_REDIS_CLUSTER"}
PROMTOOL = shutil.which("promtool")


def docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_compose_gateway_uses_the_producer_user_a_keys_file_and_its_image():
    compose = yaml.safe_load((OPS / "compose.yaml").read_text())["services"]
    gateway = compose["gateway"]
    assert gateway["build"]["dockerfile"] == "ops/Dockerfile.gateway"
    environment = gateway["environment"]
    assert set(environment) <= VARIABLES, set(environment) - VARIABLES
    assert environment["DQ_REDIS_URL"].startswith("redis://producer:")
    mounts = dict(v.split(":")[:2] for v in gateway["volumes"])
    keys_file = OPS / next(host for host, inside in mounts.items() if inside == environment[
        "DQ_GATEWAY_API_KEYS_FILE"])
    assert parse_keys(keys_file.read_text(), "the development keys")  # a valid keys file
    assert gateway["ports"] == ["127.0.0.1:8080:8080"]  # published on the host's loopback only
    assert gateway["depends_on"]["redis-setup"]["condition"] == "service_completed_successfully"


def test_gateway_image_is_torch_free_unprivileged_and_checks_health():
    text = (OPS / "Dockerfile.gateway").read_text()
    assert 'pip install ".[http]"' in text and "torch" not in text.split("COPY")[-1].split("RUN useradd")[0]
    assert re.search(r"^USER 10001$", text, re.M) and re.search(r"^EXPOSE 8080$", text, re.M)
    assert "/health" in text and re.search(r'^ENTRYPOINT \["dq-gateway"\]', text, re.M)
    ignore = (OPS / "Dockerfile.gateway.dockerignore").read_text()
    for copied in re.findall(r"^COPY (\S+)", text, re.M):
        assert (ROOT / copied).exists() and f"!{copied}" in ignore, copied


def test_kubernetes_gateway_deployment_service_autoscaler_agree():
    by_kind = {doc["kind"]: doc for doc in docs(OPS / "k8s/gateway.yaml")}
    deployment, service = by_kind["Deployment"], by_kind["Service"]
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["selector"] == selector
    assert by_kind["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == selector
    scale = by_kind["HorizontalPodAutoscaler"]["spec"]
    assert scale["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert scale["metrics"][0]["resource"]["name"] == "cpu" and scale["minReplicas"] >= 2
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert set(env) <= VARIABLES, set(env) - VARIABLES
    [port] = container["ports"]
    assert str(port["containerPort"]) == env["DQ_GATEWAY_PORT"] and service["spec"]["ports"][0]["targetPort"] == \
        port["name"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert pod["terminationGracePeriodSeconds"] > float(env["DQ_GATEWAY_MAX_WAIT_S"])
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert str(Path(env["DQ_GATEWAY_API_KEYS_FILE"]).parent) in mounts
    secrets = {doc["metadata"]["name"]: doc for doc in docs(OPS / "k8s/secret.example.yaml")}
    for volume in pod["volumes"]:
        if "secret" in volume:
            assert volume["secret"]["secretName"] in secrets
    keys = secrets["dq-gateway-keys"]["stringData"][Path(env["DQ_GATEWAY_API_KEYS_FILE"]).name]
    assert parse_keys(keys, "the example keys")
    assert "gateway.yaml" in docs(OPS / "k8s/kustomization.yaml")[0]["resources"]
    assert GatewayConfig().max_wait_s <= float(env["DQ_GATEWAY_MAX_WAIT_S"])


def test_prometheus_scrapes_the_gateway_and_its_alerts_name_its_metrics():
    config = docs(OPS / "prometheus/prometheus.yml")[0]
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "decision-queue-gateway"]
    assert job["static_configs"][0]["targets"] == ["gateway:8080"] and "gateway.yml" in config["rule_files"]
    exported = {m._name + ("_total" if type(m).__name__ == "Counter" else "") for m in vars(Metrics()).values()
                if hasattr(m, "_name")}
    labels = {label for m in vars(Metrics()).values() if hasattr(m, "_labelnames") for label in m._labelnames}
    rules = [r for group in docs(OPS / "prometheus/gateway.yml")[0]["groups"] for r in group["rules"]]
    board = json.loads((OPS / "grafana/dashboards/decision-queue.json").read_text())
    exprs = [(r["alert"], r["expr"]) for r in rules] + [(p["title"], t["expr"]) for p in board["panels"]
                                                        for t in p.get("targets", []) if "dq_gateway" in t["expr"]]
    assert len(exprs) >= 6
    for where, expr in exprs:
        for name, matchers in re.findall(r"\b(dq_gateway_[a-z_]+?)(?:_bucket|_sum|_count)?\b(?:\{([^}]*)\})?", expr):
            assert name in exported, (where, name)
            assert set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers)) <= labels | {"le", "instance"}, where
        if "up{" in expr:
            assert f'job="{job["job_name"]}"' in expr


@pytest.mark.skipif(PROMTOOL is None, reason="no promtool (apt-get install prometheus)")
def test_gateway_alerts_fire_when_they_should_and_stay_quiet_otherwise():
    rules = {r["alert"] for g in docs(OPS / "prometheus/gateway.yml")[0]["groups"] for r in g["rules"]}
    cases = [c for t in docs(OPS / "prometheus/gateway.test.yml")[0]["tests"] for c in t["alert_rule_test"]]
    assert rules == {c["alertname"] for c in cases if c["exp_alerts"]} == {c["alertname"] for c in cases
                                                                           if not c["exp_alerts"]}
    for args in (("check", "rules", "gateway.yml"), ("test", "rules", "gateway.test.yml")):
        done = subprocess.run([PROMTOOL, *args], cwd=OPS / "prometheus", capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr


def test_the_gateway_doc_lists_every_setting_and_metric():
    text = (ROOT / "docs/GATEWAY.md").read_text()
    for f in own_fields():
        assert f"`--{f.name.replace('_', '-')}` | `{env_name(f.name)}`" in text, f.name
    for metric in vars(Metrics()).values():
        if hasattr(metric, "_name"):
            assert metric._name in text, metric._name
