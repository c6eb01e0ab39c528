"""The alert rules with the real tool: ``promtool`` checks them and runs ops/prometheus/alerts.test.yml, where each
alert meets synthetic series that must fire it and series that must not (skipped without promtool: Debian's
``prometheus`` package brings it)."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

PROMETHEUS = Path(__file__).resolve().parents[2] / "ops" / "prometheus"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="no promtool (apt-get install prometheus)")


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=PROMETHEUS, capture_output=True, text=True, timeout=120)


def test_every_alert_has_a_case_that_fires_it_and_one_that_does_not():
    alerts = {rule["alert"] for group in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
              for rule in group["rules"]}
    cases = [case for test in yaml.safe_load((PROMETHEUS / "alerts.test.yml").read_text())["tests"]
             for case in test["alert_rule_test"]]
    assert alerts == {case["alertname"] for case in cases if case["exp_alerts"]}, "an alert never fires"
    assert alerts == {case["alertname"] for case in cases if not case["exp_alerts"]}, "an alert is never quiet"


@needs_promtool
def test_rules_and_scrape_config_are_valid():
    for args in (("check", "rules", "alerts.yml"), ("check", "config", "prometheus.yml")):
        done = promtool(*args)
        assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_each_alert_fires_when_it_should_and_stays_quiet_otherwise():
    done = promtool("test", "rules", "alerts.test.yml")
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr
