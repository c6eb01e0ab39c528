"""Traces: one per request, joined by the traceparent it carries, across the gateway, Redis and the worker. The
gateway's app and a worker (the real daemon) run in this process against a real server, both exporting to the
OpenTelemetry SDK's in-memory exporter; the spans' parent/child links and attributes are checked. Off (no
endpoint, or OTEL_SDK_DISABLED), no tracer exists, so no stage makes a span; on, spans leave over OTLP/HTTP (to a
local receiver here)."""

from __future__ import annotations

import asyncio
import http.server
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from inprocess import InProcessWorker
from producer.gateway.config import GatewayConfig
from producer.gateway.routes import create_app
from producer.local.binaries import servers_under_test
from producer.local.ports import free_port
from producer.plumbing import traces
from producer.plumbing.connection import Deployment

pytestmark = pytest.mark.redis
ROOT = Path(__file__).resolve().parents[2]
CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"  # the caller's own trace and span
REQUEST = {"id": "traced-1", "state": "I was charged twice.", "questions": {"refund": {"type": "noul"}}}


@pytest.fixture
def exported():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    traces.use(provider)
    try:
        yield exporter
    finally:
        traces.use(None)


async def decide(app, url: str) -> httpx.Response:
    fastapi_app = app.app  # the routes behind the front layer
    async with fastapi_app.router.lifespan_context(fastapi_app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:  # a keyless gateway: loopback
            return await http.post("/v1/decide", json=REQUEST, headers={"traceparent": CALLER}, timeout=60)


def test_one_trace_per_request_from_the_gateway_through_redis_to_the_worker(exported, redis_server, loaded):
    worker = InProcessWorker(loaded("repo"), redis_server.url).start()
    try:
        app = create_app(GatewayConfig(deployment=Deployment(url=redis_server.url)))
        reply = asyncio.run(decide(app, redis_server.url))
        assert reply.status_code == 200 and reply.json()["status"] == "ok"
        deadline = time.monotonic() + 30  # the worker writes its spans once the entry is settled
        while "dq.process" not in {span.name for span in exported.get_finished_spans()}:
            assert time.monotonic() < deadline, [span.name for span in exported.get_finished_spans()]
            time.sleep(0.02)
    finally:
        worker.stop()
    spans = {span.name: span for span in exported.get_finished_spans()}
    assert {"POST decide", "dq.enqueue", "dq.process", "dq.queue_wait", "dq.plan", "dq.compute",
            "dq.publish"} <= set(spans), sorted(spans)
    trace_id = int(CALLER.split("-")[1], 16)
    assert {span.context.trace_id for span in spans.values()} == {trace_id}  # one trace: the caller's

    def parent(name: str) -> int:
        return spans[name].parent.span_id

    call, process = spans["POST decide"], spans["dq.process"]
    assert parent("POST decide") == int(CALLER.split("-")[2], 16) and call.kind == SpanKind.SERVER
    assert parent("dq.enqueue") == call.context.span_id  # the gateway's submission to Redis
    assert parent("dq.process") == call.context.span_id and process.kind == SpanKind.CONSUMER  # the request
    for name in ("dq.queue_wait", "dq.plan", "dq.compute", "dq.publish"):  # carried it through Redis
        assert parent(name) == process.context.span_id, name
    assert process.attributes["dq.request_id"] == "traced-1" and process.attributes["dq.status"] == "ok"
    compute = spans["dq.compute"].attributes
    assert compute["dq.pack"] >= 1 and compute["dq.pack_tokens"] > 0 and "dq.bucket" in compute
    order = [spans[name] for name in ("dq.queue_wait", "dq.plan", "dq.compute", "dq.publish")]
    assert all(a.start_time <= b.start_time for a, b in zip(order, order[1:]))
    assert process.start_time <= order[0].start_time and order[-1].end_time <= process.end_time
    assert call.attributes["http.response.status_code"] == 200


def test_off_by_default_and_free_and_on_it_exports_over_otlp(tmp_path, server_binary):
    if server_binary.label != servers_under_test()[0].label:
        pytest.skip("no server is used: one run")
    code = ("from producer.gateway.config import GatewayConfig; from producer.gateway.routes import create_app; "
            "from producer.plumbing import traces; from worker.traces import Traces; "
            "print(Traces.configured(), traces.tracer('x'), create_app(GatewayConfig()).tracer)")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    for extra in ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_SDK_DISABLED": "true"}):
        off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                             env={**environ, **extra})
        assert off.returncode == 0 and off.stdout.split() == ["None"] * 3, off.stderr  # no span is ever made
    received: list[tuple[str, bytes]] = []

    class Receiver(http.server.BaseHTTPRequestHandler):  # an OTLP/HTTP collector's one route
        def do_POST(self):
            received.append((self.path, self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Receiver)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        on = subprocess.run([sys.executable, "-c", (
            "import logging; logging.basicConfig(level=logging.INFO); "
            "from producer.plumbing import traces; assert traces.configure('dq-test'); "
            "traces.tracer('t').start_span('dq.sent').end(); traces.shutdown()")], capture_output=True, text=True,
            timeout=120, cwd=ROOT, env={**environ, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT":
                                        f"http://collector:s3cret-pass@127.0.0.1:{port}/v1/traces?api_key=s3cret-key"})
    finally:
        server.shutdown()
    assert on.returncode == 0, on.stderr
    [(path, body)] = received
    assert path == "/v1/traces?api_key=s3cret-key" and b"dq.sent" in body and b"dq-test" in body
    # The endpoint's credentials reach the collector, never a log line (they were printed whole at start).
    assert f"traces exported over OTLP to http://***@127.0.0.1:{port}/v1/traces?api_key=***" in on.stderr
    assert "s3cret" not in on.stderr
