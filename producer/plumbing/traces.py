"""Traces (OpenTelemetry), shared by the gateway and the worker: off, and free, unless configured.

On when the standard OpenTelemetry variables name an OTLP endpoint (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or
``OTEL_EXPORTER_OTLP_ENDPOINT``; ``OTEL_SERVICE_NAME``, ``OTEL_EXPORTER_OTLP_HEADERS`` and the rest as the SDK
reads them; ``OTEL_SDK_DISABLED=true`` keeps it off) and the ``otel`` extra is installed (the SDK and its
OTLP/HTTP exporter); ``use`` installs a provider of the caller's (tests: the SDK's in-memory exporter). Off,
``tracer`` is None: no stage makes a span or notes a time, and nothing here imports OpenTelemetry.

One trace per request, joined by the W3C ``traceparent`` the request carries (docs/PROTOCOL.md): the gateway's
span for the call (its parent: the call's ``traceparent`` header) is what the requests it enqueues carry; its
child ``dq.enqueue`` is the submission to Redis. A worker continues the trace of each request it answers with
``dq.process`` (enqueue to settled), whose children are ``dq.queue_wait``, ``dq.plan``, ``dq.compute`` (the
pack: its id, bucket and tokens) and ``dq.publish``: worker/traces.py.
"""

from __future__ import annotations

import logging
import os
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

log = logging.getLogger("producer.traces")
ENDPOINTS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_provider: Any = None  # the TracerProvider spans go to; None: tracing off


def configure(service: str) -> bool:
    """Tracing on, exported over OTLP, when the environment asks for it (module doc); whether it is on."""
    global _provider
    if _provider is not None:
        return True
    if (not any(os.environ.get(name) for name in ENDPOINTS)
            or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true"):
        return False
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("an OTLP endpoint is set but OpenTelemetry is not installed (pip install "
                    "'decision-queue[otel]'): no traces are exported")
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME",
                                                                                       service)}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))  # endpoint, headers: from the variables
    _provider = provider
    endpoint = next(os.environ[name] for name in ENDPOINTS if os.environ.get(name))
    log.info("traces exported over OTLP to %s", shown(endpoint))
    return True


def shown(endpoint: str) -> str:
    """An endpoint as a log line may print it: its userinfo (a password, or a token as the user name) and its
    query's values (an API key) as ``***``. A collector's URL often carries its credential, and the gateway
    and the worker printed it whole at start."""
    try:
        parts = urlsplit(endpoint)
        netloc = parts.netloc
        if "@" in netloc:
            netloc = "***@" + netloc.rpartition("@")[2]
        query = "&".join(f"{name}=***" for name, _ in parse_qsl(parts.query, keep_blank_values=True))
        return urlunsplit(parts._replace(netloc=netloc, query=query, fragment=""))
    except ValueError:  # not even a URL: say so without echoing what may be a secret
        return "<unparsable URL>"


def use(provider: Any) -> None:
    """Send spans to this TracerProvider (None: tracing off)."""
    global _provider
    _provider = provider


def tracer(name: str) -> Any:
    """A tracer of the configured provider; None when tracing is off (callers then do nothing)."""
    return _provider.get_tracer(name) if _provider is not None else None


def context_of(traceparent: str | None) -> Any:
    """The OpenTelemetry context a W3C ``traceparent`` names, to parent spans with (None: a new trace)."""
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({"traceparent": traceparent})


def traceparent_of(span: Any) -> str:
    """The W3C ``traceparent`` of a span: what a request it enqueues carries."""
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def current() -> str | None:
    """The ``traceparent`` of the span in progress (the gateway's call), when tracing is on and there is one."""
    if _provider is None:
        return None
    from opentelemetry import trace

    span = trace.get_current_span()
    return traceparent_of(span) if span.get_span_context().is_valid else None


def shutdown() -> None:
    """Export what is buffered (at a clean stop)."""
    if _provider is not None and hasattr(_provider, "shutdown"):
        _provider.shutdown()
