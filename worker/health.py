"""HTTP endpoints of a worker: ``/metrics`` (Prometheus), ``/healthz`` (liveness), ``/readyz`` (readiness).

Liveness comes from the loops' own heartbeats, not from Redis: a Redis outage makes a worker unready, never
restarts it. Readiness: model loaded, graphs captured (warm-up done), Redis reachable, its function library
loaded, and not refusing the writes the work waits on (``REFUSED_READY_S`` after the last refusal), and the
work in flight progressing: a worker that holds entries and has settled none for ``--stall-timeout-s`` is
unready until one is settled, and one that has held an entry for ten times as long, until that one is settled;
and not stopping (a draining worker takes nothing new: a launcher restarted beside its old workers took them
for its own). Both are decided from a ``Snapshot``, a plain copy of the worker's state that the daemon fills
on each request; the answer names the process (``pid``), so that a supervisor can tell its own child from
whatever answers on the port.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.request
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from producer.plumbing.endpoints import NOT_FOUND, Answer, serve_paths

from .metrics import Metrics

log = logging.getLogger("worker")

STALE_SECONDS = 30.0  # a loop that has not turned for this long is stuck (a pack takes far less)
REDIS_GRACE_SECONDS = 5.0  # a read slower than its BLOCK time by this much: Redis is unreachable (unready)
HELD_STALLS = 10  # one entry held this many stall bounds is stuck, however much else settles meanwhile


@dataclass(frozen=True)
class Snapshot:
    """A plain copy of what health decides from, read once from each thread's state."""

    # loop name -> its last turn (s since the epoch): "reader", and "gpu" once it runs
    beats: dict[str, float]
    reading_since: float | None  # the reader has waited on Redis since then (None: not reading)
    loop_running: bool  # the asyncio (Redis) thread still runs
    redis_ok: bool  # the last Redis call went through
    # the server has the function library (producer/wire/library.py): results can be published
    library_ok: bool
    ready: bool  # the engine is warm
    inflight: int
    stopping: bool
    block_ms: int  # the reader's BLOCK time
    refusing: bool = False  # Redis refused a write the work waits on, lately (out of memory, an ACL, ...)
    # when the longest-held entry was taken (s since the epoch; None: none held)
    oldest_taken: float | None = None
    released_at: float | None = None  # when an entry was last let go (settled, fanned out, acknowledged)
    stall_s: float = 60.0  # held entries with nothing settled for this long: stalled
    # a heartbeat written: a worker routed to by its model is not ready before producers can find it
    present: bool = True


class Watched(Protocol):
    """What the endpoints read: the daemon, through these two only."""

    metrics: Metrics

    def snapshot(self) -> Snapshot: ...


def status(state: Snapshot) -> dict[str, Any]:
    now = time.time()
    # Only while the Redis loop runs: a reader that died mid-read is stuck, not waiting.
    reading = state.reading_since if state.loop_running else None
    # A reader blocked on an unresponsive Redis (paused, partitioned: each call waits out its socket timeout
    # and retries) is not stuck itself: restarting it would not help, so it makes the worker unready, not
    # dead.
    stuck = [name for name, beat in state.beats.items()
             if now - beat > STALE_SECONDS and not (name == "reader" and reading is not None)]
    if state.ready and "gpu" not in state.beats:
        stuck.append("gpu")
    # A healthy blocking read returns within its BLOCK time; much longer means Redis is not answering.
    redis_ok = state.redis_ok and not (reading is not None
                                       and now - reading > state.block_ms / 1000 + REDIS_GRACE_SECONDS)
    # In-flight work that cannot progress (a refused write retried, a task lost): nothing settled since the
    # oldest held entry was taken, or since the last settlement, whichever is later, for longer than the
    # bound.
    waiting = 0.0
    if state.oldest_taken is not None:
        waiting = now - max(state.oldest_taken, state.released_at or 0.0)
    # And one entry left behind while the rest moves (its idle time kept fresh, so no other worker takes it).
    held = now - state.oldest_taken if state.oldest_taken is not None else 0.0
    stalled = waiting > state.stall_s or held > HELD_STALLS * state.stall_s
    ready = (state.ready and redis_ok and state.library_ok and state.present and not stuck and not stalled
             and not state.refusing and not state.stopping)
    return {"live": not stuck, "stuck": stuck, "ready": ready, "model_loaded": True, "warm": state.ready,
            "redis": redis_ok, "library": state.library_ok, "present": state.present, "refusing": state.refusing, "stalled": stalled,
            "inflight": state.inflight, "stopping": state.stopping, "pid": os.getpid()}


def serve_http(daemon: Watched, port: int, host: str = "") -> ThreadingHTTPServer:
    """Serve the endpoints in a thread, on ``host`` (``--metrics-host``; ``""``: every interface, IPv6 and
    IPv4), and say where. ``/health`` is ``/healthz`` for clients used to TEI's and vLLM's name."""

    def answer(path: str) -> Answer:
        if path == "/metrics":
            daemon.metrics.set_ready(status(daemon.snapshot())["ready"])
            return 200, generate_latest(daemon.metrics.registry), CONTENT_TYPE_LATEST
        if path not in ("/healthz", "/health", "/readyz"):
            return NOT_FOUND
        state = status(daemon.snapshot())
        code = 200 if state["ready" if path == "/readyz" else "live"] else 503
        return code, json.dumps(state).encode(), "application/json"

    server = serve_paths(host, port, answer)
    bound = server.server_address[0]
    where = "every interface" if host in ("", "::", "0.0.0.0") else (f"[{bound}]" if ":" in bound else bound)
    log.info("serving /metrics, /healthz (/health) and /readyz on port %d of %s",
             server.server_address[1], where)
    return server


def check(url: str, path: str = "/readyz", timeout: float = 3.0) -> int:
    """``python -m worker check``: 0 when the endpoint answers 200, else 1 (for container health checks)."""
    endpoint = url.rstrip("/") + path
    try:
        with urllib.request.urlopen(endpoint, timeout=timeout) as reply:
            print(reply.read().decode())
            return 0 if reply.status == 200 else 1
    except OSError as error:
        body = getattr(error, "read", lambda: b"")()
        print(f"{endpoint}: {error.code} {body.decode()}" if body else f"{endpoint} unreachable: {error}")
        return 1
