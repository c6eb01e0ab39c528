"""Logging: one line per state change (never one per request at INFO), as text or JSON (the formats:
producer/plumbing/logs.py, the gateway's too).

With ``json``, every line the process writes to stderr is a JSON object: progress bars are off, and
third-party handlers, warnings and uncaught exceptions go through the one handler.

A line about one request carries its id and, when the request brought one, its W3C ``traceparent`` (passed as
``extra=delivery.log_fields``): a JSON field of its own, or ``[request ... traceparent ...]`` at the end of a
text line, so a trace can be followed into this worker's logs.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

from producer.plumbing.logs import formatter


def setup_logging(fmt: str = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if fmt == "json":
        _everything_through_logging()
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def _everything_through_logging() -> None:
    """Every line on stderr a JSON object: no progress bars (transformers' "Loading weights", any tqdm),
    transformers' messages through the root handler instead of its own, Python warnings and uncaught
    exceptions (main thread and others) as log records. A log collector parsing lines would choke on anything
    else."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.captureWarnings(True)
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:
        pass
    else:
        transformers_logging.disable_progress_bar()
        transformers_logging.disable_default_handler()
        transformers_logging.enable_propagation()
    log = logging.getLogger("worker")

    def uncaught(kind: type[BaseException], error: BaseException, trace: Any) -> None:
        if issubclass(kind, KeyboardInterrupt):
            sys.__excepthook__(kind, error, trace)
            return
        log.critical("uncaught exception", exc_info=(kind, error, trace))

    def uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread else "?"
        log.error("uncaught exception in thread %s", name, exc_info=(args.exc_type, args.exc_value,
                                                                      args.exc_traceback))

    sys.excepthook, threading.excepthook = uncaught, uncaught_in_thread
