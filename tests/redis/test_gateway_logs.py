"""The gateway's own lines as an operator reads them, from a real ``python -m producer.gateway`` process: with
``--log-format json`` every line it writes, uvicorn's included, is one JSON object; each call has one access line
(method, path, status, duration, key, lane, client), probes and scrapes none at INFO; the first line says the
version; ``--cors-allow-origin`` answers a browser's preflight before any key is asked for, and names the origin on
the answer; ``--access-log off`` writes none. Text lines are the worker's format."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from gateways import GatewayProcess, auth, request
from producer import __version__
from producer.local.binaries import servers_under_test

pytestmark = pytest.mark.redis
KEYS = [{"name": "acme", "token": "test-token-acme-0123456789abcdef", "namespace": "quiet"}]  # no worker there
ORIGIN = "https://app.example"


@pytest.fixture
def one_run(server_binary):
    if server_binary.label != servers_under_test()[0].label:
        pytest.skip("what the gateway writes does not depend on the server: one run")


def test_json_lines_access_lines_and_cors(one_run, redis_server, tmp_path):
    log = tmp_path / "gateway.log"
    gateway = GatewayProcess(redis_server.url, log, KEYS, log_format="json", cors_allow_origin=ORIGIN).wait_up()
    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            queued = http.post("/v1/requests", json=request("logged-1", priority="high"),
                               headers={**auth("acme"), "Origin": ORIGIN})
            assert queued.status_code == 202 and queued.headers["access-control-allow-origin"] == ORIGIN
            assert http.post("/v1/requests", json=request("x")).status_code == 401
            preflight = http.options("/v1/decide", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                                            "Access-Control-Request-Headers": "authorization"})
            assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
            assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
            other = http.options("/v1/decide", headers={"Origin": "https://evil.example",
                                                        "Access-Control-Request-Method": "POST"})
            assert "access-control-allow-origin" not in other.headers
            assert http.get("/info").json() == {"version": __version__, "protocol": "1"}
            for _ in range(3):
                http.get("/health"), http.get("/metrics")
    finally:
        gateway.stop()
    lines = [json.loads(line) for line in log.read_text().splitlines()]  # every line: one JSON object
    assert all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
    assert any(line["logger"].startswith("uvicorn") for line in lines)  # uvicorn's own, in the same format
    assert any(f"dq-gateway {__version__} (wire protocol v1)" in line["msg"] for line in lines)
    calls = [line for line in lines if line["logger"] == "producer.gateway.access"]
    assert [(c["method"], c["path"], c["status"]) for c in calls] == [
        ("POST", "/v1/requests", 202), ("POST", "/v1/requests", 401)]  # no probe, scrape or preflight at INFO
    assert calls[0]["key"] == "acme" and calls[0]["lane"] == "high" and calls[0]["duration_ms"] >= 0
    assert calls[1]["key"] == "" and re.fullmatch(r"127\.0\.0\.1:\d+", calls[0]["client"])


def test_text_lines_without_access_lines(one_run, redis_server, tmp_path):
    log = tmp_path / "gateway.log"
    gateway = GatewayProcess(redis_server.url, log, KEYS, access_log="off").wait_up()
    try:
        assert httpx.post(gateway.url + "/v1/requests", json=request("quiet-1"), headers=auth("acme"),
                          timeout=30).status_code == 202
    finally:
        gateway.stop()
    text = log.read_text()
    assert "producer.gateway.access" not in text
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: "
    assert all(re.match(stamp, line) for line in text.splitlines()), text  # uvicorn's lines too
