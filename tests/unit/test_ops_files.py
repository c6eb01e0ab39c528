"""ops/ without a docker engine or a cluster: every file parses, every PromQL name is a metric the worker exports
(with labels it has), and compose, Prometheus, Grafana, the Dockerfile and the Kubernetes manifests agree with each
other and with the worker's settings. The compose file and the built-in Kubernetes kinds are validated against
their schemas (bundled by check-jsonschema and kubernetes-validate: no network)."""

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import yaml
from prometheus_client import Counter, Histogram

from producer.admin.exporter import EXPORTED
from producer.gateway.metrics import Metrics as GatewayMetrics
from producer.wire.keys import GROUP, LANES, Keys
from worker.config import Settings
from worker.launch.host import devices
from worker.launch.launcher import Launcher
from worker.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "ops"
sys.path.insert(0, str(OPS / "grafana"))
SETTINGS = {Settings.env_name(f.name) for f in fields(Settings)}
ALWAYS = {"instance", "job", "le"}  # labels Prometheus and histograms add


def load(path: Path) -> list:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def exported() -> dict[str, set[str]]:
    """Every sample name a worker (with the process and Python collectors), a launcher or the exporter exports -> its
    labels."""
    metrics = Metrics()
    out = {sample.name: set(sample.labels) for family in metrics.registry.collect() for sample in family.samples
           if not sample.name.startswith("dq_")}
    launcher = Launcher(Settings(gpus="cpu:1"), devices("cpu:1", {}), environ={}, cores=1)
    for metric in [*vars(metrics).values(), *vars(GatewayMetrics()).values(), *vars(launcher).values()]:
        if not hasattr(metric, "_name"):
            continue
        labels = set(metric._labelnames)
        if isinstance(metric, Counter):
            out[metric._name + "_total"] = labels
        elif isinstance(metric, Histogram):
            for suffix in ("_bucket", "_sum", "_count"):
                out[metric._name + suffix] = labels | {"le"}
        else:
            out[metric._name] = labels
    return out | {name: set(labels) for name, labels in EXPORTED.items()}


def check_promql(expr: str, where: str) -> None:
    names = exported()
    used = re.findall(r"\b((?:dq|process|python)_[a-z0-9_]+)\b", expr)
    assert used or "up{" in expr, f"{where}: no worker metric in {expr}"
    for name in used:
        assert name in names, f"{where}: {name} is not exported by worker/metrics.py"
    for name, matchers in re.findall(r"\b((?:dq|process|python)_[a-z0-9_]+)\{([^}]*)\}", expr):
        for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
            assert label in names[name] | ALWAYS, f"{where}: {name} has no label {label}"
    for clause in re.findall(r"\bby \(([^)]*)\)", expr):
        for label in (x.strip() for x in clause.split(",")):
            assert any(label in labels for labels in names.values()) or label in ALWAYS, f"{where}: by {label}"


def compose() -> dict:
    return yaml.safe_load((OPS / "compose.yaml").read_text())


def defaults(text: str) -> dict[str, str]:
    """${VAR:-default} interpolations of a compose value."""
    return dict(re.findall(r"\$\{(\w+):-([^}]*)\}", text))


# ---------------------------------------------------------------- everything parses


@pytest.mark.parametrize("path", sorted(p.relative_to(OPS).as_posix() for p in OPS.rglob("*")
                                        if p.suffix in (".yaml", ".yml", ".json") and "bench" not in p.parts))
def test_parses(path):
    file = OPS / path
    if file.suffix == ".json":
        json.loads(file.read_text())
    else:
        assert load(file), path


# ---------------------------------------------------------------- Grafana and Prometheus


def test_dashboard_is_the_generator_output_and_names_only_exported_metrics():
    import dashboard

    text = (OPS / "grafana/dashboards/decision-queue.json").read_text()
    assert text == dashboard.render(), "run python ops/grafana/dashboard.py after changing it"
    board = json.loads(text)
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
        for target in panel.get("targets", []):
            check_promql(target["expr"], panel["title"])
    titles = " ".join(p["title"].lower() for p in panels)
    for topic in ("results", "latency", "lag", "stream length", "pack fill", "error", "gpu memory", "tokens",
                  "queue wait", "forward", "redis errors"):
        assert topic in titles, topic
    exprs = " ".join(t["expr"] for p in panels for t in p.get("targets", []))
    assert "histogram_quantile(0.99" in exprs and "histogram_quantile(0.5" in exprs  # latency percentiles


def test_grafana_provisioning_points_at_the_dashboard_and_the_datasource():
    [source] = load(OPS / "grafana/provisioning/datasources/prometheus.yaml")[0]["datasources"]
    board = json.loads((OPS / "grafana/dashboards/decision-queue.json").read_text())
    [variable] = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert variable["current"]["value"] == source["uid"] and source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"
    [provider] = load(OPS / "grafana/provisioning/dashboards/decision-queue.yaml")[0]["providers"]
    mounts = dict(v.split(":")[:2] for v in compose()["services"]["grafana"]["volumes"] if v.startswith("./"))
    assert mounts["./grafana/dashboards"] == provider["options"]["path"]
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"


def test_alerts_and_scrape_config():
    config = load(OPS / "prometheus/prometheus.yml")[0]
    for rule_file in config["rule_files"]:
        assert (OPS / "prometheus" / rule_file).exists()
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "decision-queue-worker"]
    workers = [name for name in compose()["services"] if name.startswith("worker")]
    port = compose()["services"]["worker-0"]["environment"]["DQ_METRICS_PORT"]
    assert sorted(job["static_configs"][0]["targets"]) == sorted(f"{w}:{port}" for w in workers)
    rules = [r for group in load(OPS / "prometheus/alerts.yml")[0]["groups"] for r in group["rules"]]
    assert len(rules) >= 6
    for rule in rules:
        assert rule["alert"] and rule["annotations"]["summary"]
        check_promql(rule["expr"], rule["alert"])
        assert "job=" not in rule["expr"], "job names differ between compose and a PodMonitor"


# ---------------------------------------------------------------- compose, Redis, the image


def test_compose_wires_redis_worker_prometheus_grafana():
    from ops.redis_acl import DEVELOPMENT_PASSWORDS, render

    services = compose()["services"]
    assert {"redis", "worker-0", "prometheus", "grafana"} <= set(services)
    redis = services["redis"]
    config_path = redis["command"][-1]
    mounts = dict(v.split(":")[:2] for v in redis["volumes"] if v.startswith("./"))
    conf = (OPS / "redis/redis.conf").read_text()
    directives = dict(line.split(None, 1) for line in conf.splitlines() if line and not line.startswith("#"))
    assert mounts["./redis/redis.conf"] == config_path
    assert mounts["./redis/users.acl"] == directives["aclfile"]
    assert directives["appendonly"] == "yes" and directives["maxmemory-policy"] == "noeviction"
    assert (OPS / "redis/users.acl").read_text() == render(DEVELOPMENT_PASSWORDS)  # python ops/redis_acl.py --dev.
    worker = services["worker-0"]
    [device] = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    environment = worker["environment"]
    assert set(environment) <= SETTINGS, set(environment) - SETTINGS
    url = environment["DQ_REDIS_URL"]
    assert url.startswith("redis://worker:") and url.endswith("@redis:6379/0")
    assert defaults(url)["DQ_ACL_WORKER_PASSWORD"] == DEVELOPMENT_PASSWORDS["worker"]
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    # The function library is loaded by an admin before any worker starts (workers may not load it).
    setup = services["redis-setup"]
    assert setup["command"] == ["load-functions"] and setup["image"] == worker["image"]
    assert setup["environment"]["DQ_REDIS_URL"].startswith("redis://admin:")
    assert defaults(setup["environment"]["DQ_REDIS_URL"])["DQ_ACL_ADMIN_PASSWORD"] == DEVELOPMENT_PASSWORDS["admin"]
    assert worker["depends_on"]["redis-setup"]["condition"] == "service_completed_successfully"
    grace = int(worker["stop_grace_period"].rstrip("s"))
    assert grace > float(environment["DQ_DRAIN_TIMEOUT_S"])
    assert worker["build"]["dockerfile"] == "ops/Dockerfile" and (OPS / "..").resolve() == ROOT


def test_compose_file_matches_the_compose_spec():
    pytest.importorskip("check_jsonschema")
    import importlib.resources

    import jsonschema

    schema = json.loads((importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
                         / "compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = sorted(error.message for error in validator.iter_errors(compose()))
    assert not errors, errors


def test_the_two_model_compose_file_adds_a_namespace_of_its_own():
    """ops/compose.models.yaml over ops/compose.yaml: the second model's worker and exporter read their own
    namespace, Redis takes the ACL file of both namespaces, and the gateway may route to both."""
    from ops.redis_acl import DEVELOPMENT_PASSWORDS, render

    override = yaml.safe_load((OPS / "compose.models.yaml").read_text())["services"]
    base = compose()["services"]
    [acl] = override["redis"]["volumes"]
    assert acl.split(":")[1] == next(v for v in base["redis"]["volumes"] if "users.acl" in v).split(":")[1]
    assert (OPS / acl.split(":")[0]).read_text() == render(DEVELOPMENT_PASSWORDS, "dq*")
    worker, exporter = override["worker-b"], override["queue-exporter-b"]
    assert set(worker["environment"]) <= SETTINGS and set(worker["environment"]) >= set(
        base["worker-0"]["environment"]), "worker-b is worker-0 in another namespace"
    assert worker["environment"]["DQ_NAMESPACE"] == exporter["environment"]["DQ_NAMESPACE"] == "dq-b"
    assert exporter["command"] == base["queue-exporter"]["command"]
    namespaces = override["gateway"]["environment"]["DQ_GATEWAY_MODEL_NAMESPACES"].split(",")
    assert namespaces == ["dq", "dq-b"]
    if importlib.util.find_spec("check_jsonschema"):
        import jsonschema
        from importlib.resources import files

        schema = json.loads((files("check_jsonschema.builtin_schemas.vendor")
                             / "compose-spec.json").read_text())
        merged = {**compose(), "services": {**base, **override}}
        assert not list(jsonschema.validators.validator_for(schema)(schema).iter_errors(merged))


def test_dockerfile_runs_the_worker_unprivileged_with_a_health_check():
    text = (OPS / "Dockerfile").read_text()
    assert re.search(r'^HEALTHCHECK .*CMD \["python", "-m", "worker", "check"\]', text, re.M)
    assert re.search(r"^USER 10001$", text, re.M)
    assert re.search(r'^ENTRYPOINT \["python", "-m", "worker"\]', text, re.M)
    port = re.search(r"DQ_METRICS_PORT=(\d+)", text).group(1)
    assert re.search(rf"^EXPOSE {port}$", text, re.M)
    for copied in re.findall(r"^COPY (\S+)", text, re.M):
        assert (ROOT / copied).exists(), copied
        assert f"!{copied}" in (OPS / "Dockerfile.dockerignore").read_text()


# ---------------------------------------------------------------- Kubernetes


def manifests() -> dict[tuple[str, str], dict]:
    out = {}
    for path in (OPS / "k8s").glob("*.yaml"):
        for doc in load(path):
            out[(doc["kind"], doc["metadata"]["name"] if "metadata" in doc else path.name)] = doc
    return out


def test_kubernetes_built_in_kinds_validate_against_their_schemas():
    validate = pytest.importorskip("kubernetes_validate")
    checked = 0
    for (kind, name), doc in manifests().items():
        if "." in doc["apiVersion"].split("/")[0]:
            continue  # CRDs (KEDA, the Prometheus Operator, kustomize): checked structurally below
        for version in ("1.28.0", validate.latest_version()):
            validate.validate(doc, version, strict=True)
        checked += 1
    assert checked >= 6


def test_worker_deployment_gpu_probes_and_grace_period():
    docs = manifests()
    deployment = docs[("Deployment", "dq-worker")]
    config = docs[("ConfigMap", "dq-worker")]["data"]
    assert set(config) <= SETTINGS, set(config) - SETTINGS
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["terminationGracePeriodSeconds"] > float(config["DQ_DRAIN_TIMEOUT_S"])
    [port] = container["ports"]
    assert port["name"] == "metrics" and str(port["containerPort"]) == config["DQ_METRICS_PORT"]
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert container[probe]["httpGet"] == {"path": path, "port": "metrics"}, probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # minutes to load a large checkpoint
    env = {e["name"]: e for e in container["env"]}
    assert set(env) <= SETTINGS
    assert "secretKeyRef" in env["DQ_REDIS_URL"]["valueFrom"]
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == config["DQ_METRICS_PORT"]
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/tmp" in mounts and "DQ_REDIS_TLS_CA" not in config  # TLS: components/redis-tls (tests/unit/test_k8s.py)
    assert str(Path(config["DQ_CHECKPOINT"]).parent) in mounts
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert docs[("PodDisruptionBudget", "dq-worker")]["spec"]["selector"]["matchLabels"] == selector
    assert docs[("PodMonitor", "dq-worker")]["spec"]["selector"]["matchLabels"] == selector


def test_keda_scales_the_worker_on_the_lag_of_its_shard_as_the_monitor_user():
    docs = manifests()
    scaled = docs[("ScaledObject", "dq-worker")]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert ("Deployment", scaled["spec"]["scaleTargetRef"]["name"]) in docs
    config = docs[("ConfigMap", "dq-worker")]["data"]
    keys = Keys(config["DQ_NAMESPACE"], int(config["DQ_SHARD"]))
    triggers = scaled["spec"]["triggers"]
    assert {t["metadata"]["stream"] for t in triggers} == {  # both lanes' work streams
        stream for lane in LANES for stream in (keys.requests_in(lane), keys.parts_in(lane))}
    known = {"address", "host", "port", "stream", "consumerGroup", "lagCount", "activationLagCount",
             "databaseIndex", "enableTLS", "unsafeSsl", "usernameFromEnv", "passwordFromEnv"}
    for trigger in triggers:
        meta = trigger["metadata"]
        assert trigger["type"] == "redis-streams" and set(meta) <= known
        assert meta["consumerGroup"] == GROUP and int(meta["lagCount"]) > 0  # lag: XINFO GROUPS, Redis 7+
        assert all(isinstance(v, str) for v in meta.values())  # KEDA metadata values are strings
        auth = docs[("TriggerAuthentication", trigger["authenticationRef"]["name"])]
    secrets = {name: set(doc.get("stringData", {})) for (kind, name), doc in docs.items() if kind == "Secret"}
    for ref in auth["spec"]["secretTargetRef"]:
        assert ref["parameter"] in {"username", "password", "tls", "ca", "cert", "key", "keyPassword"}
        assert ref["key"] in secrets[ref["name"]], ref
    assert docs[("Secret", "dq-redis-monitor")]["stringData"]["username"] == "monitor"
    pod = docs[("Deployment", "dq-worker")]["spec"]["template"]["spec"]
    for volume in pod["volumes"]:
        if "secret" in volume:
            assert volume["secret"]["secretName"] in secrets
    for e in pod["containers"][0]["env"]:
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            assert ref["key"] in secrets[ref["name"]]
    assert scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


def test_kustomization_lists_existing_files_and_renders():
    kustomization = load(OPS / "k8s/kustomization.yaml")[0]
    for resource in kustomization["resources"]:
        assert (OPS / "k8s" / resource).exists(), resource
    if not shutil.which("kubectl"):
        pytest.skip("no kubectl to render the kustomization")
    rendered = subprocess.run(["kubectl", "kustomize", str(OPS / "k8s")], capture_output=True, text=True,
                              timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    kinds = [doc["kind"] for doc in yaml.safe_load_all(rendered.stdout)]
    assert {"Deployment", "ScaledObject", "TriggerAuthentication", "ConfigMap"} <= set(kinds)


def test_operations_doc_lists_every_metric():
    text = (ROOT / "docs/OPERATIONS.md").read_text()
    for metric in vars(Metrics()).values():
        if hasattr(metric, "_name"):
            name = metric._name + ("_total" if isinstance(metric, Counter) else "")
            assert f"`{name}`" in text, name
