"""The layer every call passes before its route, as plain ASGI: who is calling (one ``Authorization: Bearer``
header naming a key: 401 before a byte of the body is read), what a keyless gateway accepts (a loopback
``Host`` only, and a body that is JSON or comes with an ``Authorization`` header: a web page on the same
machine can neither submit nor read through it, by a form or by a DNS name pointed at 127.0.0.1), admission
(admission.py: an in-flight slot and a share of the body budget before the body is read, the body read within
limits), and the metrics (calls by route, lane and status; latency; calls in flight), counted after the
response's last byte. What a call holds is given back when it ends, however it ends (a streamed batch whose
caller went away included: counted 499).
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...plumbing import traces
from ...wire.schema import valid_traceparent
from . import logs
from .access import Keyring
from .admission import CLOSE, Admission
from .disconnects import CLIENT_GONE
from .replies import JSON, Refused, error_body

if TYPE_CHECKING:
    from ..metrics import Metrics

# A keyless gateway's other bodies need a header no web page can send cross-site without a CORS
# preflight, which the gateway answers only for --cors-allow-origin: JSON's content type, or an
# Authorization header (any value; every System One SDK sends one, and a multipart body with images).
UNSENDABLE_BY_A_FORM = ("a gateway without API keys takes a body that is not Content-Type: "
                        "application/json only from a call with an Authorization header (any value: the "
                        "System One SDKs send one), which a web page's form cannot send; send JSON, or add "
                        "'Authorization: Bearer anything'")
PUBLIC = {"health", "ready", "info", "metrics", "docs", "other"}  # no key needed: nothing of a tenant is there
# Each path's route name, a bounded label whatever the path (a dialect adds its own: ``Front.speak``).
ROUTES = {"/v1/decide": "decide", "/v1/decide/batch": "decide_batch", "/v1/requests": "requests", "/health": "health",
          "/ready": "ready", "/info": "info", "/metrics": "metrics", "/docs": "docs", "/redoc": "docs",
          "/openapi.json": "docs"}


@dataclass(frozen=True)
class Dialect:
    """Another API served on some routes, whose callers read answers in a shape of their own: a refusal the
    front layer makes on those routes is ``reshape``d (status, the gateway's error body -> the API's body),
    and every answer there carries the id ``header`` (``fresh_id()`` where the route set none). System One
    registers one (producer/gateway/systemone/routes.py), so the front layer names no API of its own
    accord."""

    routes: dict[str, str]  # path -> route name
    header: str
    fresh_id: Callable[[], str]
    reshape: Callable[[int, bytes], bytes]


class Front:
    """The ASGI layer in front of the routes: keys, admission, metrics, the call's span and access line."""

    def __init__(self, app: ASGIApp, keyring: Keyring, admission: Admission, metrics: Metrics,
                 tracer: Any = None) -> None:
        self.app, self.keyring, self.admission, self.metrics = app, keyring, admission, metrics
        self.tracer = tracer  # None: tracing off (producer/plumbing/traces.py)
        self.gateway: Any = None  # the service behind (routes.create_app sets it: the server reads its connections)
        self.routes = dict(ROUTES)
        self.dialects: dict[str, Dialect] = {}  # route name -> the dialect its answers speak

    def speak(self, dialect: Dialect) -> None:
        """Answer on ``dialect``'s routes in its shape."""
        self.routes.update(dialect.routes)
        self.dialects.update((route, dialect) for route in dialect.routes.values())

    def route_of(self, path: str) -> str:
        """The route's name, a bounded label whatever the path."""
        if path.startswith("/v1/results/"):
            return "results"
        if path.startswith("/v1/requests/"):
            return "request"  # one request's status or cancel
        if path.startswith("/docs/"):
            return "docs"  # the pages' assets (producer/gateway/pages.py)
        return self.routes.get(path, "other")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, route = time.perf_counter(), self.route_of(scope["path"])
        dialect = self.dialects.get(route)
        state: dict[str, Any] = scope.setdefault("state", {})
        status, ended = [500], [False]  # until the response starts: a call cut short counts as failed

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                if dialect is not None:
                    header = dialect.header.encode()
                    if not any(name == header for name, _ in message.get("headers", ())):
                        message["headers"] = [*message.get("headers", ()), (header, dialect.fresh_id().encode())]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended[0] = True
                self.admission.leave(state)  # before the caller sees the end: its next call may come at once
            await send(message)

        gauge = self.metrics.in_flight.labels(route)
        gauge.inc()
        end_span = self._span(scope, route) if self.tracer is not None and route not in PUBLIC else None
        try:
            try:
                self._admit(scope, route, state)
            except Refused as refused:
                await _answer(sending, refused, dialect)
                return
            await self.app(scope, self.admission.receiving(receive, state), sending)
        finally:
            gauge.dec()
            self.admission.leave(state)  # a call cut short, or one that failed before its last byte
            if state.get("gone") and not ended[0]:
                status[0] = CLIENT_GONE  # its caller hung up before the answer's end: nobody read it
            if end_span is not None:  # the call's span: ended once its last byte went
                end_span(status[0])
            lane, seconds = state.get("lane", ""), time.perf_counter() - started
            self.metrics.calls.labels(route, lane, str(status[0])).inc()
            self.metrics.seconds.labels(route, lane).observe(seconds)
            logs.called(scope, status[0], seconds, route in PUBLIC, state)

    def _span(self, scope: Scope, route: str) -> Any:
        """Start the call's span, current while it runs (its parent: the call's ``traceparent`` header; the
        requests it enqueues carry it, service.py); what ends it with the call's status."""
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

    def _admit(self, scope: Scope, route: str, state: dict[str, Any]) -> None:
        """Raises Refused: 400 a keyless gateway's Host not a loopback name, 401 without one valid key, 415 a
        keyless body that is neither JSON nor sent with an Authorization header, 413 a declared length over the limit, 429/503 no room
        (admission.py)."""
        headers: dict[bytes, list[bytes]] = {}
        for name, value in scope["headers"]:
            headers.setdefault(name, []).append(value)
        if self.keyring.open and not _loopback_host(headers.get(b"host")):
            raise Refused(400, "host_not_allowed", "a gateway without API keys answers only to a loopback Host "
                          "(localhost, 127.0.0.1, [::1])", headers=CLOSE)
        if route in PUBLIC:
            return
        given = headers.get(b"authorization", [])
        access = self.keyring.find(given[0].decode("latin-1") if len(given) == 1 else None)
        if access is None:
            raise Refused(401, "unauthorized", "a valid API key is needed: one Authorization: Bearer <token>",
                          headers={"WWW-Authenticate": 'Bearer realm="dq-gateway"', **CLOSE})
        state["access"] = access
        body = scope["method"] in ("POST", "PUT", "PATCH")
        if body and self.keyring.open and not given and not _json(headers.get(b"content-type")):
            raise Refused(415, "unsupported_media_type", UNSENDABLE_BY_A_FORM, headers=CLOSE)
        declared = headers.get(b"content-length", [None])[-1]
        if declared is not None and not declared.isdigit():
            raise Refused(413, "body_too_large", "the body's Content-Length is not a number", headers=CLOSE)
        self.admission.enter(state, access, int(declared) if declared is not None else None, body)


def _loopback_host(values: list[bytes] | None) -> bool:
    """A Host header that names this machine by a loopback name (no header at all: HTTP/1.0, a probe)."""
    if not values:
        return True
    if len(values) > 1:
        return False
    host = values[0].decode("latin-1").strip().lower()
    name = host[1:].partition("]")[0] if host.startswith("[") else host.rpartition(":")[0] if ":" in host else host
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _json(values: list[bytes] | None) -> bool:
    return bool(values) and values[0].split(b";")[0].strip().lower() == b"application/json"


async def _answer(send: Send, refused: Refused, dialect: Dialect | None) -> None:
    body = error_body(refused.code, refused.message, field=refused.field, **refused.extra)
    if dialect is not None:  # its callers' shape
        body = dialect.reshape(refused.status, body)
    raw = [(b"content-type", JSON.encode()), (b"content-length", str(len(body)).encode())]
    raw += [(name.lower().encode(), value.encode()) for name, value in refused.headers.items()]
    await send({"type": "http.response.start", "status": refused.status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
