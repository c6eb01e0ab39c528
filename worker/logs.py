"""Logging: one line per state change (never one per request at INFO), as text or JSON.

A line about one request carries its id and, when the request brought one, its W3C ``traceparent`` (passed as
``extra=delivery.log_fields``): a JSON field of its own, or ``[request ... traceparent ...]`` at the end of a text
line, so a trace can be followed into this worker's logs.
"""

from __future__ import annotations

import json
import logging
import time

REQUEST_FIELDS = ("request_id", "traceparent")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        line.update({name: getattr(record, name) for name in REQUEST_FIELDS if hasattr(record, name)})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        about = " ".join(f"{name.removesuffix('_id')} {getattr(record, name)}" for name in REQUEST_FIELDS
                         if hasattr(record, name))
        return super().formatMessage(record) + (f" [{about}]" if about else "")


def setup_logging(fmt: str = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
