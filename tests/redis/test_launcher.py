"""``dq-worker serve --gpus cpu:2``: one launcher, two CPU worker processes (the tiny checkpoint), a real server.
A worker killed with kill -9 while it holds entries is started again under its consumer name and recovers them;
SIGTERM of the launcher drains both workers and exits 0; every request is answered exactly once.

Run on the first server only: the launcher's own Redis call is one XPENDING, and what its workers do with Redis is
the daemon's, tested on every server elsewhere (test_faults.py, test_lifecycle.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from faults import FAULTY, batch, wait_for
from producer.admin.audit import check, wait_and_check
from producer.client import Client
from producer.local.binaries import servers_under_test
from producer.local.ports import free_ports
from support import http_get

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def get(url: str) -> tuple[int, str]:
    """``http_get``, tried again on a failure: on a 2-core machine under other tests' load an answer can take over
    its 2 s."""
    for _ in range(4):
        try:
            return http_get(url)
        except OSError:
            time.sleep(0.2)
    return http_get(url)


def pending_of(client: Client, consumer: str) -> int:
    summary = client.redis.xpending(client.keys.requests, client.keys.group)
    return sum(int(c["pending"]) for c in summary["consumers"] or [] if c["name"].decode() == consumer)


def test_a_killed_worker_is_restarted_and_sigterm_drains_every_worker(server_binary, redis_server, tiny_dir,
                                                                      tmp_path):
    if server_binary.label != servers_under_test()[0].label:
        pytest.skip("one server is enough: the workers' use of Redis is tested on each elsewhere")
    port, log = free_ports(3), tmp_path / "launcher.log"
    launcher = subprocess.Popen(
        [sys.executable, *FAULTY, "serve", "--gpus", "cpu:2", "--checkpoint", str(tiny_dir), "--redis-url",
         redis_server.url, "--metrics-port", str(port), "--read-count", "4", "--max-inflight", "8"],
        env=dict(os.environ, DQ_FAULT_SLOW_S="0.3", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
        stdout=open(log, "wb"), stderr=subprocess.STDOUT)

    def state() -> dict:
        return json.loads(get(f"http://127.0.0.1:{port}/readyz")[1])

    def ready() -> bool:
        try:
            return get(f"http://127.0.0.1:{port}/readyz")[0] == 200
        except OSError:
            assert launcher.poll() is None, log.read_text()[-3000:]
            return False

    try:
        wait_for(ready, timeout=120, every=0.2, what="both workers ready")
        workers = state()["workers"]
        assert [(w["device"], w["port"]) for w in workers] == [("cpu", port + 1), ("cpu", port + 2)]
        assert get(f"http://127.0.0.1:{port + 2}/readyz")[0] == 200  # each worker serves its own endpoints
        client = Client(redis_server.url)
        ids = client.submit_many(batch(16, "host"))
        victim = workers[0]
        wait_for(lambda: pending_of(client, victim["consumer"]), timeout=30, what="worker 0 holding entries")
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(lambda: ready() and state()["workers"][0]["pid"] != victim["pid"], timeout=120, every=0.2,
                 what="worker 0 started again and ready")
        wait_and_check(client.redis, client.keys, ids, timeout=90).assert_ok()
        restarted = {s.labels["how"]: s.value for f in text_string_to_metric_families(
            get(f"http://127.0.0.1:{port + 1}/metrics")[1]) for s in f.samples
            if s.name == "dq_entries_read_total" and s.labels["stream"] == "requests"}
        assert restarted["recovered"] >= 1  # its own pending entries, under the same consumer name, at once
        launcher_metrics = get(f"http://127.0.0.1:{port}/metrics")[1]
        assert 'dq_launcher_restarts_total{worker="0"} 1.0' in launcher_metrics
        assert 'dq_launcher_restarts_total{worker="1"} 0.0' in launcher_metrics

        more = client.submit_many(batch(16, "drain"))
        wait_for(lambda: sum(pending_of(client, w["consumer"]) for w in state()["workers"]), timeout=30,
                 what="entries in work")
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 0, log.read_text()[-3000:]
        assert client.redis.xpending(client.keys.requests, client.keys.group)["pending"] == 0
        report = check(client.redis, client.keys, ids + more, drained=False)
        assert not report.duplicated and not report.malformed and all(r.ok for r in report.results.values())
        assert len(report.missing) == client.redis.xlen(client.keys.requests)  # unread, still queued: not lost
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
    text = log.read_text()
    assert text.count("worker 0 killed by SIGKILL") == 1 and "exited" not in text  # one line per crash
    assert "stopped: every worker drained, nothing left pending" in text


def launch_exiting(code: int, redis_url: str, port: int, log) -> subprocess.Popen:
    """A launcher of two workers that exit with ``code`` at once (no model: the launcher's side alone)."""
    script = ("import sys; from worker.launch import launcher; from worker.__main__ import main; "
              f"launcher.ENTRY = ['-c', 'import sys; sys.exit({code})']; sys.exit(main(sys.argv[1:]))")
    return subprocess.Popen([sys.executable, "-c", script, "serve", "--gpus", "cpu:2", "--checkpoint", "unused",
                             "--redis-url", redis_url, "--metrics-port", str(port)],
                            env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT)


def test_a_worker_that_keeps_exiting_is_reported_and_an_exit_2_stops_the_host(server_binary, redis_server, tmp_path):
    if server_binary.label != servers_under_test()[0].label:
        pytest.skip("one server is enough: the launcher's one Redis call is the same on each")
    port, log = free_ports(3), tmp_path / "loop.log"
    looping = launch_exiting(3, redis_server.url, port, log)
    try:
        def state() -> tuple[int, dict]:
            try:
                code, body = get(f"http://127.0.0.1:{port}/readyz")
            except OSError:
                return 0, {"workers": []}
            return code, json.loads(body)

        # Exits after 1 s and 2 s of pause: the third in a row comes about 3 s after the start.
        def looping_each() -> bool:
            workers = state()[1]["workers"]
            return bool(workers) and all(w["exits_in_a_row"] >= 3 for w in workers)

        wait_for(looping_each, timeout=30, what="three exits in a row")
        code, body = state()
        assert code == 503 and body["live"] and not body["ready"]  # unready, never unlive: the launcher stays
        assert get(f"http://127.0.0.1:{port}/healthz")[0] == 200
        metrics = get(f"http://127.0.0.1:{port}/metrics")[1]
        assert 'dq_launcher_worker_ready{worker="0"} 0.0' in metrics
        assert [line for line in metrics.splitlines() if line.startswith("dq_launcher_exits_in_a_row{")]
        looping.send_signal(signal.SIGTERM)
        assert looping.wait(30) == 0  # nothing was taken, nothing is pending: all drained
    finally:
        if looping.poll() is None:
            looping.kill()
    lines = [line for line in log.read_text().splitlines() if "worker 0 exited 3" in line]
    assert len(lines) >= 3 and "(1 in a row): starting it again in 1 s" in lines[0]
    assert "(2 in a row): starting it again in 2 s" in lines[1]

    refused = launch_exiting(2, redis_server.url, free_ports(3), tmp_path / "refused.log")
    assert refused.wait(30) == 2  # the same settings would fail every worker the same way: no restart
    assert "refused to start (exit 2)" in (tmp_path / "refused.log").read_text()


def test_a_launcher_counts_only_its_own_workers_and_waits_for_a_port_still_held(server_binary, redis_server,
                                                                                  tiny_dir, tmp_path):
    """Restarted right after its own kill -9, a launcher found its orphaned workers still draining on the ports:
    it reported ready before its own workers loaded (it trusted whatever answered), then its workers could not bind
    and exited 2, and it stopped the whole host. Here a stand-in holds the worker's port and answers /readyz 200 as
    such an orphan did: the launcher stays unready (not its child), its worker exits 75 and is started again after
    a pause, and once the port is free the launcher is ready with its own worker."""
    import http.server
    import threading

    if server_binary.label != servers_under_test()[0].label:
        pytest.skip("one server is enough: the launcher's one Redis call is the same on each")
    port, log = free_ports(2), tmp_path / "launcher.log"

    class Orphan(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = json.dumps({"ready": True, "live": True, "pid": 1}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    orphan = http.server.ThreadingHTTPServer(("", port + 1), Orphan)
    threading.Thread(target=orphan.serve_forever, daemon=True).start()
    launcher = subprocess.Popen(
        [sys.executable, "-m", "worker", "serve", "--gpus", "cpu:1", "--checkpoint", str(tiny_dir), "--redis-url",
         redis_server.url, "--metrics-port", str(port)],
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), stdout=open(log, "wb"),
        stderr=subprocess.STDOUT)

    def ready() -> tuple[int, dict]:
        try:
            code, body = get(f"http://127.0.0.1:{port}/readyz")
            return code, json.loads(body)
        except OSError:
            return 0, {}

    try:
        wait_for(lambda: "worker 0 exited 75" in log.read_text(), timeout=120, every=0.2,
                 what="the worker to find its port held")
        assert launcher.poll() is None and ready()[0] == 503  # not its child's answer: not ready
        orphan.shutdown()
        orphan.server_close()
        wait_for(lambda: ready()[0] == 200, timeout=180, every=0.2, what="the launcher's own worker ready")
        [worker] = ready()[1]["workers"]
        assert json.loads(get(f"http://127.0.0.1:{port + 1}/readyz")[1])["pid"] == worker["pid"]
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
    assert "refused to start (exit 2)" not in log.read_text()
