"""Log lines about one request carry its id and traceparent, in text and in JSON; other lines are unchanged."""

import json
import logging

from producer.plumbing.logs import JsonFormatter, TextFormatter

TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def record(message: str, **extra: str) -> logging.LogRecord:
    line = logging.LogRecord("worker", logging.WARNING, __file__, 1, message, (), None)
    line.__dict__.update(extra)
    return line


def test_request_lines_carry_the_request_and_its_traceparent():
    about = record("prompt of r-1 failed", request_id="r-1", traceparent=TRACE)
    text = TextFormatter().format(about)
    assert text.endswith(f"WARNING worker: prompt of r-1 failed [request r-1 traceparent {TRACE}]")
    assert json.loads(JsonFormatter().format(about))["traceparent"] == TRACE
    untraced = record("published r-2: ok", request_id="r-2")
    assert TextFormatter().format(untraced).endswith("published r-2: ok [request r-2]")
    assert "traceparent" not in json.loads(JsonFormatter().format(untraced))
    plain = record("ready")
    assert TextFormatter().format(plain).endswith("WARNING worker: ready")
    assert set(json.loads(JsonFormatter().format(plain))) == {"ts", "level", "logger", "msg"}
