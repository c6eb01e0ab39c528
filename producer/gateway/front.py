"""The layer every call passes before its route, as plain ASGI: the API key (401 before a byte of the body is
read), the body's size (413 on the declared length, or as soon as a streamed body passes the limit), and the
metrics (calls by route, lane and status; latency; calls in flight), counted after the response's last byte. It
also gives back the caller's in-flight slots when the call ends, however it ends (a streamed batch whose caller
went away included).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import __version__
from ..wire import traces
from ..wire.schema import valid_traceparent
from . import logs
from .access import Inflight, Keyring
from .replies import JSON, error_body
from .translate import ID_HEADER as TYPESAFE_ID
from .translate import fresh_id, reshaped

PUBLIC = {"health", "ready", "info", "metrics", "docs", "other"}  # no key needed: nothing of a tenant is there
SYSTEM_ONE = {"systemone", "models"}  # routes whose every answer is shaped for the System One clients
ID_HEADER = TYPESAFE_ID.encode()
# No ``_created`` series beside each counter and histogram (process-wide): no alert or panel reads them, and they
# doubled the counters' series (worker/metrics.py does the same).
disable_created_metrics()
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def route_of(path: str) -> str:
    """The route's name, a bounded label whatever the path."""
    if path.startswith("/v1/results/"):
        return "results"
    return {"/v1/decide": "decide", "/v1/decide/batch": "decide_batch", "/v1/requests": "requests",
            "/v1/systemone": "systemone", "/v1/models": "models", "/health": "health", "/ready": "ready",
            "/info": "info", "/metrics": "metrics", "/docs": "docs", "/redoc": "docs",
            "/openapi.json": "docs"}.get(path, "other")


class Metrics:
    """The gateway's own registry (a process may hold others)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.calls = Counter("dq_gateway_requests", "HTTP calls answered, by route, lane and status",
                             ["route", "lane", "status"], registry=self.registry)
        self.seconds = Histogram("dq_gateway_request_seconds", "time from a call's arrival to its last byte, by "
                                 "route and lane", ["route", "lane"], buckets=BUCKETS, registry=self.registry)
        self.in_flight = Gauge("dq_gateway_in_flight", "HTTP calls being answered, by route", ["route"],
                               registry=self.registry)
        self.queued = Counter("dq_gateway_queued_requests", "requests the gateway put on the queue, by lane",
                              ["lane"], registry=self.registry)
        self.attached = Counter("dq_gateway_calls_attached", "System One calls answered by a request an earlier "
                                "call enqueued: a client's retry, or an identical call within the retry window",
                                ["how"], registry=self.registry)
        self.build = Gauge("dq_gateway_build_info", "always 1: the version this gateway runs", ["version"],
                           registry=self.registry)
        self.build.labels(__version__).set(1)


class Front:
    def __init__(self, app: ASGIApp, keyring: Keyring, inflight: Inflight, metrics: Metrics,
                 max_body_bytes: int, tracer: Any = None) -> None:
        self.app, self.keyring, self.inflight, self.metrics = app, keyring, inflight, metrics
        self.max_body_bytes = max_body_bytes
        self.tracer = tracer  # None: tracing off (producer/wire/traces.py)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, route = time.perf_counter(), route_of(scope["path"])
        state: dict[str, Any] = scope.setdefault("state", {})
        status = [500]  # until the response starts: a call cut short counts as failed

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                if route in SYSTEM_ONE and not any(name == ID_HEADER for name, _ in message.get("headers", ())):
                    message["headers"] = [*message.get("headers", ()), (ID_HEADER, fresh_id().encode())]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                self._give_back(state)  # before the caller sees the end: its next call may come at once
            await send(message)

        gauge = self.metrics.in_flight.labels(route)
        gauge.inc()
        end_span = self._span(scope, route) if self.tracer is not None and route not in PUBLIC else None
        try:
            refusal = self._refuse(scope, route, state)
            if refusal is not None and route in SYSTEM_ONE:  # the System One clients' shape (translate.py)
                refusal = (refusal[0], reshaped(*refusal[:2]), refusal[2])
            if refusal is not None:
                await _answer(sending, *refusal)
                return
            await self.app(scope, self._counting(receive), sending)
        finally:
            if end_span is not None:  # the call's span: ended once its last byte went
                end_span(status[0])
            gauge.dec()
            self._give_back(state)  # a call cut short, or one that failed before its last byte
            lane, seconds = state.get("lane", ""), time.perf_counter() - started
            self.metrics.calls.labels(route, lane, str(status[0])).inc()
            self.metrics.seconds.labels(route, lane).observe(seconds)
            logs.called(scope, status[0], seconds, route in PUBLIC, state)

    def _span(self, scope: Scope, route: str) -> Any:
        """Start the call's span, current while it runs (its parent: the call's ``traceparent`` header; the requests
        it enqueues carry it, service.py); what ends it with the call's status."""
        from opentelemetry import context
        from opentelemetry.trace import SpanKind, set_span_in_context

        header = dict(scope["headers"]).get(b"traceparent")
        span = self.tracer.start_span(f"{scope['method']} {route}", kind=SpanKind.SERVER, attributes={
            "http.request.method": scope["method"], "http.route": route},
            context=traces.context_of(valid_traceparent(header.decode("latin-1") if header else None)))
        token = context.attach(set_span_in_context(span))

        def end(status: int) -> None:
            span.set_attribute("http.response.status_code", status)
            context.detach(token)
            span.end()

        return end

    def _give_back(self, state: dict[str, Any]) -> None:
        for name, count in state.pop("held", ()):
            self.inflight.give_back(name, count)

    def _refuse(self, scope: Scope, route: str, state: dict[str, Any]) -> tuple[int, bytes, dict] | None:
        """401 without a known key, 413 for a declared length over the limit; else None (the call goes on)."""
        headers = dict(scope["headers"])
        if route not in PUBLIC:
            raw = headers.get(b"authorization")
            access = self.keyring.find(raw.decode("latin-1") if raw is not None else None)
            if access is None:
                return 401, error_body("unauthorized", "a valid API key is needed: Authorization: Bearer <token>"), \
                    {"WWW-Authenticate": 'Bearer realm="dq-gateway"'}
            state["access"] = access
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            return 413, error_body("body_too_large", f"the body is over the {self.max_body_bytes}-byte limit"), {}
        return None

    def _counting(self, receive: Receive) -> Receive:
        """``receive`` that refuses a body (streamed without a length) once it passes the limit."""
        seen = [0]

        async def counted() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_body_bytes:
                    raise HTTPException(413, {"code": "body_too_large",
                                              "message": f"the body is over the {self.max_body_bytes}-byte limit"})
            return message

        return counted


async def _answer(send: Send, status: int, body: bytes, headers: dict[str, str]) -> None:
    raw = [(b"content-type", JSON.encode()), (b"content-length", str(len(body)).encode())]
    raw += [(name.lower().encode(), value.encode()) for name, value in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
