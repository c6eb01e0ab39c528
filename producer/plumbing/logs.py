"""One log format for every process of the project, the worker's and the gateway's (and the libraries' lines
they pass on): text, ``2026-01-01 12:00:00,000 INFO worker: ready ...``, or one JSON object per line (``ts``
in UTC with milliseconds, ``level``, ``logger``, ``msg``, ``exc`` with a traceback, and the known fields a
line carries: a request's id and ``traceparent``, a call's method, path, status, duration, key, lane and
client).
"""

from __future__ import annotations

import json
import logging
import time

REQUEST_FIELDS = ("request_id", "traceparent")  # a line about one request (``extra=identity.log_fields``)
CALL_FIELDS = ("method", "path", "status", "duration_ms", "key", "lane", "client")  # the gateway's access lines
FIELDS = REQUEST_FIELDS + CALL_FIELDS


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the request's or call's fields."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        line.update({name: getattr(record, name) for name in FIELDS if hasattr(record, name)})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The message as written; a line about one request ends with ``[request <id> traceparent <tp>]``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        about = " ".join(f"{name.removesuffix('_id')} {getattr(record, name)}" for name in REQUEST_FIELDS
                         if hasattr(record, name))
        return super().formatMessage(record) + (f" [{about}]" if about else "")


def formatter(fmt: str) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else TextFormatter()


class Throttled:
    """A line at most every ``every`` seconds per kind of event, saying how many of that kind came since the
    last one (each is counted in a metric at once; the log only sums them up)."""

    def __init__(self, every: float) -> None:
        self.every = every
        self.logged: dict[str, float] = {}  # kind -> when its last line went (monotonic)
        self.since: dict[str, int] = {}  # kind -> events since its last line, this one included

    def due(self, kind: str) -> int:
        """One more event of ``kind``: how many since the last line when a line is due now (it is then written
        by the caller), else 0."""
        self.since[kind] = self.since.get(kind, 0) + 1
        now = time.monotonic()
        if now - self.logged.get(kind, float("-inf")) < self.every:
            return 0
        self.logged[kind] = now
        count, self.since[kind] = self.since[kind], 0
        return count
