"""The alert rules (ops/prometheus: the workers' alerts.yml, the gateway's gateway.yml, Redis' redis.yml) and where
they go: each alert has a case that fires it and one that does not; every rule has a severity of one set, a
description and a runbook link to a section of docs/OPERATIONS.md that exists, and names no job label; the
Alertmanager routes that severity set. With the real tools where installed: ``promtool`` checks the rules and the
scrape config and runs each rule file's test file, ``amtool`` checks the Alertmanager's config (skipped without
them: Debian's ``prometheus`` and ``prometheus-alertmanager`` packages bring them)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "ops" / "prometheus"
RULE_FILES = ("alerts.yml", "gateway.yml", "redis.yml")
SEVERITIES = {"critical", "warning"}  # critical: someone acts now; warning: someone looks within the day
PROMTOOL, AMTOOL = shutil.which("promtool"), shutil.which("amtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="no promtool (apt-get install prometheus)")


def rules(name: str) -> list[dict]:
    return [rule for group in yaml.safe_load((PROMETHEUS / name).read_text())["groups"] for rule in group["rules"]]


def every_rule() -> list[dict]:
    return [rule for name in RULE_FILES for rule in rules(name)]


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a document's headings."""
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
            for heading in re.findall(r"^#+ (.+)$", markdown, re.M)}


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", RULE_FILES)
def test_every_alert_has_a_case_that_fires_it_and_one_that_does_not(name):
    alerts = {rule["alert"] for rule in rules(name)}
    test_file = PROMETHEUS / name.replace(".yml", ".test.yml")
    spec = yaml.safe_load(test_file.read_text())
    assert spec["rule_files"] == [name]
    cases = [case for test in spec["tests"] for case in test["alert_rule_test"]]
    assert alerts == {case["alertname"] for case in cases if case["exp_alerts"]}, "an alert never fires"
    assert alerts == {case["alertname"] for case in cases if not case["exp_alerts"]}, "an alert is never quiet"


def test_every_rule_has_a_severity_of_one_set_a_description_and_a_runbook_that_exists():
    sections = anchors((ROOT / "docs" / "OPERATIONS.md").read_text())
    names = [rule["alert"] for rule in every_rule()]
    assert len(names) == len(set(names)) and len(names) >= 30
    for rule in every_rule():
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}, rule["alert"]
        assert len(rule["annotations"]["description"]) > len(rule["annotations"]["summary"]) / 2, rule["alert"]
        page, _, anchor = rule["annotations"]["runbook_url"].partition("#")
        assert page == "docs/OPERATIONS.md" and anchor == rule["alert"].lower(), rule["alert"]
        assert anchor in sections, f"docs/OPERATIONS.md has no section {rule['alert']}"
        # Scrape configs name jobs differently (compose's decision-queue-worker, a PodMonitor's namespace/name).
        assert not re.search(r"\bjob\s*(=|!=|=~|!~)", rule["expr"]), rule["alert"]


def test_the_operator_gets_every_rule_file():
    import runpy

    render = runpy.run_path(str(PROMETHEUS / "operator_rules.py"))["render"]
    generated = yaml.safe_load(render())
    assert [r["alert"] for g in generated["spec"]["groups"] for r in g["rules"]] == [r["alert"] for r in every_rule()]
    based = yaml.safe_load(render("https://docs.example/"))["spec"]["groups"][0]["rules"][0]["annotations"]
    assert based["runbook_url"] == "https://docs.example/docs/OPERATIONS.md#decisionqueueworkerdown"


def test_prometheus_loads_every_rule_file_and_sends_to_the_alertmanager_which_routes_the_severities():
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert config["rule_files"] == list(RULE_FILES)
    [target] = config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    compose = yaml.safe_load((ROOT / "ops" / "compose.yaml").read_text())["services"]
    assert target.split(":")[0] in compose and "./alertmanager:/etc/alertmanager:ro" in compose["alertmanager"][
        "volumes"]
    manager = yaml.safe_load((ROOT / "ops" / "alertmanager" / "alertmanager.yml").read_text())
    routed = {re.fullmatch(r'severity="(\w+)"', m).group(1) for route in manager["route"]["routes"]
              for m in route["matchers"]}
    receivers = {r["name"] for r in manager["receivers"]}
    assert routed | {manager["route"]["receiver"]} == SEVERITIES == receivers
    exporter = compose["redis-exporter"]  # Redis' own metrics, read as the monitor user, without CONFIG GET
    assert exporter["environment"]["REDIS_USER"] == "monitor" and "--config-command=-" in exporter["command"]
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "redis"]
    assert job["static_configs"][0]["targets"] == ["redis-exporter:9121"]


@needs_promtool
@pytest.mark.parametrize("name", RULE_FILES)
def test_each_rule_file_is_valid_and_its_alerts_fire_when_they_should_and_stay_quiet_otherwise(name):
    for args in (("check", "rules", name), ("test", "rules", name.replace(".yml", ".test.yml"))):
        done = promtool(*args)
        assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


@needs_promtool
def test_the_scrape_config_is_valid():
    done = promtool("check", "config", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(AMTOOL is None, reason="no amtool (apt-get install prometheus-alertmanager)")
def test_the_alertmanager_config_is_valid():
    done = subprocess.run([AMTOOL, "check-config", "ops/alertmanager/alertmanager.yml"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
