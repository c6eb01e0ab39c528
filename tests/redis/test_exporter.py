"""The queue exporter (``dq-producer exporter``) against a real server under the ACL users: as the read-only
monitor it reports each shard's and lane's backlog, dead letters and live workers with no worker running, and says
when Redis stops answering instead of failing the scrape."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ops.redis_acl import ROLES, render
from producer.local.ports import free_port
from producer.local.server import RedisServer
from producer.wire.keys import HIGH, NORMAL, Keys

pytestmark = pytest.mark.redis
ROOT = Path(__file__).resolve().parents[2]
PASSWORDS = {role: f"test-{role}-password" for role in ROLES}


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_exporter_reports_the_backlog_as_the_monitor_with_no_worker_and_survives_redis_going(tmp_path):
    acl = tmp_path / "users.acl"
    acl.write_text(render(PASSWORDS))
    with RedisServer("--aclfile", str(acl)) as server:
        import redis

        admin = redis.Redis.from_url(f"redis://admin:{PASSWORDS['admin']}@127.0.0.1:{server.port}/0")
        shard0, shard1 = Keys("dq", 0), Keys("dq", 1)
        # shard 0: 5 normal requests, a group that took 2 of them; 1 high request, no group yet; 2 dead letters
        for n in range(5):
            admin.xadd(shard0.requests, {"body": json.dumps({"id": f"r{n}"})})
        admin.xgroup_create(shard0.requests, shard0.group, id="0")
        admin.xreadgroup(shard0.group, "gone-worker", {shard0.requests: ">"}, count=2)
        admin.xadd(shard0.requests_in(HIGH), {"body": "{}"})
        admin.xadd(shard0.dead, {"stream": "requests", "reason": "x"})
        admin.xadd(shard0.dead, {"stream": "requests", "reason": "y"})
        admin.xadd(shard1.parts, {"request_id": "big", "part": "0"})
        admin.hset(shard0.workers(), "w-old", json.dumps({"ts": time.time() - 600}))
        port = free_port()
        monitor = f"redis://monitor:{PASSWORDS['monitor']}@127.0.0.1:{server.port}/0"
        exporter = subprocess.Popen([sys.executable, "-m", "producer", "exporter", "--port", str(port),
                                     "--host", "127.0.0.1", "--redis-url", monitor, "--shards", "2"],
                                    cwd=ROOT, env=os.environ, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    samples = scrape(port)
                    break
                except OSError:
                    assert exporter.poll() is None and time.monotonic() < deadline, exporter.stderr.read()
                    time.sleep(0.1)

            def value(name: str, **labels: str) -> float:
                return samples[(name, tuple(sorted(labels.items())))]

            normal0 = {"shard": "0", "stream": "requests", "lane": str(NORMAL)}
            assert value("dq_stream_length", **normal0) == 5 and value("dq_stream_pending", **normal0) == 2
            assert value("dq_stream_lag", **normal0) == 3 and value("dq_stream_consumers", **normal0) == 1
            high0 = {"shard": "0", "stream": "requests", "lane": str(HIGH)}
            assert value("dq_stream_lag", **high0) == 1  # no group yet: all of it waits
            assert value("dq_stream_lag", shard="1", stream="chunks", lane=str(NORMAL)) == 1
            assert value("dq_dead_letter_entries", shard="0") == 2 and value("dq_dead_letter_entries", shard="1") == 0
            assert value("dq_workers_live") == 0 and value("dq_exporter_redis_up") == 1
            assert admin.acl_log() == []  # the monitor's rights were enough
            server.stop()
            start = time.monotonic()
            samples = scrape(port)  # a scrape still answers, at once, saying Redis is gone
            assert time.monotonic() - start < 6 and value("dq_exporter_redis_up") == 0
            assert not any(name == "dq_stream_lag" for name, _ in samples)
        finally:
            exporter.send_signal(signal.SIGTERM)
            assert exporter.wait(10) == 0
        log = exporter.stderr.read()
        assert "serving the queue of namespace dq (2 shards) at http://127.0.0.1:" in log
        assert "cannot read the queue at redis://monitor:***@127.0.0.1:" in log and PASSWORDS["monitor"] not in log
