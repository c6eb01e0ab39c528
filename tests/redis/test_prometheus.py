"""The operator's view with the real tools: a real Prometheus scrapes real workers of two shards and the queue
exporter, every query of
the provisioned dashboard returns the series its panel is meant to show, and the alert rules load and evaluate
cleanly (skipped without a ``prometheus`` binary: Debian's package brings it)."""

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from producer.admin.exporter import Exporter, serve
from producer.client import Client
from producer.local.binaries import servers_under_test
from producer.local.ports import free_port
from test_e2e import requests

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
pytestmark = [pytest.mark.redis, pytest.mark.slow,
              pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus server (apt-get install prometheus)")]
# Only a CUDA worker has GPU memory to report; these workers run on CPU.
CUDA_ONLY = ("dq_gpu_memory_bytes",)


def query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as reply:
        answer = json.load(reply)
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.5)
    return value


@pytest.fixture
def prometheus(tmp_path):
    """Start one on a free port with the project's alert rules; ``scrape(targets)`` points it at workers."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    process = None

    def scrape(targets: list[str]) -> int:
        nonlocal process
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ROOT / "ops/prometheus/alerts.yml")],
            "scrape_configs": [{"job_name": "decision-queue-worker", "static_configs": [{"targets": targets}]}]}))
        process = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                    f"--web.listen-address=127.0.0.1:{port}"],
                                   stdout=open(tmp_path / "prometheus.log", "wb"), stderr=subprocess.STDOUT)

        def ready() -> bool:
            assert process.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2) as reply:
                    return reply.status == 200
            except OSError:
                return False

        wait_for(ready, 60, "prometheus did not start")
        return port

    yield scrape
    if process is not None:
        process.terminate()
        process.wait(30)


def test_a_real_prometheus_scrapes_workers_and_every_panel_shows_its_series(server_binary, redis_server, start_worker,
                                                                             tiny_dir, prometheus):
    if server_binary.label != servers_under_test()[0].label:
        pytest.skip("one server is enough: what the workers export and the panels query do not depend on it")
    workers = [start_worker(tiny_dir, redis_server.url, ready=False, shard=shard, max_prompt_tokens=220,
                            fanout_tokens=200) for shard in (0, 1)]  # both load at once
    for worker in workers:
        worker.wait_ready()
    client = Client(redis_server.url, shards=2)
    exporter_port = free_port()
    exporter = serve(Exporter(Client(redis_server.url, shards=2).stats, redis_server.url), "127.0.0.1",
                     exporter_port)
    port = prometheus([f"127.0.0.1:{w.port}" for w in workers] + [f"127.0.0.1:{exporter_port}"])
    many = {f"q{i}": {"type": "noul", "instructions": f"Is statement {i} true?"} for i in range(20)}
    batch = [*requests(40, "p"), {"id": "long", "state": "Some state.", "questions": many},
             {"id": "bad", "state": "x", "questions": {"q": {"type": "choice", "criteria": {
                 f"option-{i}": None for i in range(20)}}}}]
    results = client.wait_many(client.submit_many(batch), timeout=120)
    assert results["bad"].error and all(r.ok for i, r in results.items() if i != "bad")
    # Both workers scraped, and the maintenance loops' queue gauges (every 5 s) arrived from both shards.
    wait_for(lambda: len(query(port, 'dq_stream_lag{stream="requests"}')) == 8  # 2 shards x 2 lanes, twice
             and sum(float(s["value"][1]) for s in query(port, "dq_results_total")) == len(batch), 60,
             "queue gauges or results not scraped")
    # Enough scrapes of each worker since for rate() over the panels' window to have points to work with.
    wait_for(lambda: [float(s["value"][1]) >= 5 for s in query(port, "count_over_time(up[30s])")] == [True] * 3, 60,
             "too few scrapes")

    board = json.loads((ROOT / "ops/grafana/dashboards/decision-queue.json").read_text())
    checked = 0
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$instance", ".*").replace("$model", ".*").replace("$__rate_interval",
                                                                                                "30s")
            if "dq_gateway_" in expr:  # the gateway's row: no gateway here (tests/unit/test_gateway_ops.py holds
                continue                # its panels to the metrics the gateway exports)
            series = query(port, expr)
            if any(name in expr for name in CUDA_ONLY):
                assert series == [], (panel["title"], "GPU memory on a CPU worker")
                continue
            assert series, f"panel {panel['title']!r}: no series for {expr}"
            for label in re.findall(r"\{\{(\w+)\}\}", target["legendFormat"]):  # what the legend shows is there
                assert all(label in s["metric"] for s in series), (panel["title"], label, series)
            checked += 1
    assert checked > 30
    per_shard = query(port, 'sum by (shard) (max by (shard, stream, lane) (dq_stream_length{instance=~".*"}))')
    assert {s["metric"]["shard"] for s in per_shard} == {"0", "1"}
    lanes = query(port, 'count by (lane) (dq_stream_lag{stream="requests"})')
    assert {s["metric"]["lane"]: float(s["value"][1]) for s in lanes} == {"high": 4, "normal": 4}  # + exporter
    by_status = query(port, "sum by (status) (dq_results_total)")
    assert {s["metric"]["status"]: float(s["value"][1]) for s in by_status} == {"ok": len(batch) - 1, "error": 1}

    # The alert rules load into the real server and evaluate without error; nothing fires on a healthy queue.
    def evaluated() -> list[dict]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=10) as reply:
            rules = [r for g in json.load(reply)["data"]["groups"] for r in g["rules"]]
        return rules if rules and all(r.get("lastEvaluation", "").startswith("2") for r in rules) else []

    rules = wait_for(evaluated, 30, "alert rules not evaluated")
    alerts = yaml.safe_load((ROOT / "ops/prometheus/alerts.yml").read_text())["groups"][0]["rules"]
    assert {r["name"] for r in rules} == {a["alert"] for a in alerts}
    assert all(r["health"] == "ok" and not r.get("lastError") for r in rules), rules
    assert [r["name"] for r in rules if r["state"] != "inactive"] == []
    exporter.shutdown()
