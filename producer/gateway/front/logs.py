"""The gateway's lines, in one format (``--log-format text`` or ``json``, producer/plumbing/logs.py: the
worker's too), its own and uvicorn's alike, and one access line per call (``--access-log``): method, path,
status, duration, the key's name, the lane and the client's address; the public routes (probes, scrapes, docs)
at DEBUG only. CORS for browsers on other origins (``--cors-allow-origin``), answered before the API key is
asked for (a preflight carries none).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ...plumbing.logs import formatter
from ..config import GatewayConfig

if TYPE_CHECKING:  # the command imports this module before it knows the http extra is there (plumbing/extras.py)
    from starlette.types import ASGIApp

access = logging.getLogger("producer.gateway.access")


def setup(config: GatewayConfig) -> None:
    """Every line of the process through one handler in the chosen format (uvicorn's included: it is run with
    ``log_config=None``, so it installs none of its own)."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(config.log_format))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(config.log_level.upper())
    logging.captureWarnings(True)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    access.disabled = config.access_log != "on"


def called(scope: dict[str, Any], status: int, seconds: float, public: bool, state: dict[str, Any]) -> None:
    """The access line of one call (front.py, once its last byte went)."""
    level = logging.DEBUG if public else logging.INFO
    if not access.isEnabledFor(level):
        return
    key = state.get("access")
    client = scope.get("client")
    fields = {"method": scope["method"], "path": scope["path"], "status": status,
              "duration_ms": round(seconds * 1000, 1), "key": getattr(key, "name", ""), "lane": state.get("lane", ""),
              "client": f"{client[0]}:{client[1]}" if client else ""}
    access.log(level, "%s %s %d %.1f ms key=%s lane=%s client=%s", *fields.values(), extra=fields)


def cors(app: ASGIApp, config: GatewayConfig) -> ASGIApp:
    """``app`` behind CORS for the configured origins (none: as it is)."""
    from starlette.middleware.cors import CORSMiddleware

    origins = [origin.strip() for origin in config.cors_allow_origin.split(",") if origin.strip()]
    if not origins:
        return app
    return CORSMiddleware(app, allow_origins=origins, allow_methods=["GET", "POST"],
                          allow_headers=["Authorization", "Content-Type", "traceparent"],
                          expose_headers=["Location", "Retry-After"], max_age=600)
