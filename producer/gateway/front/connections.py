"""The gateway's HTTP connections, before a request reaches the application: uvicorn's HTTP/1.1 protocol
(httptools) with the limits it lacks, so that nobody, with or without a key, can hold the process's memory or
file descriptors.

uvicorn closes a keep-alive connection idle after a response (``timeout_keep_alive``, used here:
``--keep-alive-s``), and nothing before a request's head (request line and headers) is complete: with
httptools no size limit on it (h11 has one, 16 KiB, at about half the calls per core) and with either no time
limit (uvicorn's issue 157 lists both as open). Four connections sending megabytes of headers took the gateway
from 58 MB to 1 GB; thousands of half-sent ones held file descriptors until it refused everyone. Here each
connection's head must be:

- within ``--max-header-bytes``, else 431 and the connection closed (before the parser holds more than a read);
- complete within ``--header-timeout-s`` of the connection's start, or of the first byte after its previous
  request, else 408 and closed (an idle connection between requests is the keep-alive timer's, which is
  longer: clients keep idle connections in their pools, the System One SDK 30 s);

and at most ``--max-connections`` are open at once: one more closes the longest-idle keep-alive connection,
else the one that has been sending its head longest, if for over ``SLOW_HEAD_S`` (or half the header timeout,
if that is less: a caller's head comes in one packet; a slowloris connection is at once the slowest and the
first to go, so a flood of them never shuts newcomers out for the whole header timeout), else is answered 503
and closed. A call in progress is never closed for another. Each closing is counted
(``dq_gateway_connections_closed_total{reason}``) and logged at most once a minute per reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ...plumbing.logs import Throttled
from .replies import error_body

log = logging.getLogger("producer.gateway")
LOG_EVERY_S = 60.0
SLOW_HEAD_S = 1.0  # a head still coming after this long may be closed to make room when the connections are full
HEAD_ENDS = (b"\r\n\r\n", b"\n\n")
REASONS = {  # reason -> (status line, error code, what the log says)
    "header_timeout": (b"408 Request Timeout", "header_timeout", "did not finish a request's headers in time"),
    "header_too_large": (b"431 Request Header Fields Too Large", "header_too_large",
                         "sent a request head over the header limit"),
    "over_limit": (b"503 Service Unavailable", "too_many_connections", "came over the connection limit with none "
                                                                      "idle to close"),
    "idle_evicted": (b"", "", "were idle keep-alive connections closed to make room for new ones"),
    "slow_evicted": (b"408 Request Timeout", "header_timeout", "were still sending a request's head, over a second, "
                                                                "when a new connection needed room"),
    "invalid_request": (b"", "", "sent what is not HTTP (uvicorn answered 400)"),
}
INVALID = "Invalid HTTP request received."  # uvicorn's warning, once per bad request: counted here instead


@dataclass(frozen=True)
class Limits:
    """The connection limits: how many at once, a request head's size and time."""

    max_connections: int
    max_header_bytes: int
    header_timeout_s: float


class Connections:
    """The open connections, the limits, and the counts (``metrics``: front.Metrics)."""

    def __init__(self, limits: Limits, metrics: Any) -> None:
        self.limits, self.metrics = limits, metrics
        self.open: dict[GuardedProtocol, None] = {}  # in the order they opened
        self.lines = Throttled(LOG_EVERY_S)  # a line a minute at most per reason
        # uvicorn logs a warning for every request that is not HTTP: a flood of them was a flood of lines
        logging.getLogger("uvicorn.error").addFilter(lambda record: record.getMessage() != INVALID)

    def protocol(self) -> type[asyncio.Protocol]:
        """The protocol class for uvicorn's ``http`` setting, bound to these connections."""
        return type("GuardedProtocol", (GuardedProtocol,), {"guard": self})

    @property
    def full(self) -> bool:
        return len(self.open) >= self.limits.max_connections

    def opened(self, connection: GuardedProtocol) -> bool:
        """Room for a new connection: False when there is none (the caller refuses it)."""
        self.open[connection] = None
        if len(self.open) > self.limits.max_connections:
            now = time.monotonic()
            idle = [c for c in self.open if c.idle_since is not None and c is not connection]
            slower = min(SLOW_HEAD_S, self.limits.header_timeout_s / 2)
            slow = [c for c in self.open if c.head_since is not None and now - c.head_since > slower
                    and c is not connection]
            if idle:
                min(idle, key=lambda c: c.idle_since or 0.0).close_idle()
            elif slow:
                min(slow, key=lambda c: c.head_since or 0.0).refuse("slow_evicted")
            else:
                return False
        self.metrics.connections.set(len(self.open))
        return True

    def lost(self, connection: GuardedProtocol) -> None:
        self.open.pop(connection, None)
        self.metrics.connections.set(len(self.open))

    def count(self, reason: str, peer: Any) -> None:
        """A connection closed by a limit: counted; logged at most once per LOG_EVERY_S per reason, saying how
        many since the last line (those in between are in the metric at once, and in the next line)."""
        self.metrics.closed.labels(reason).inc()
        if count := self.lines.due(reason):
            log.warning("closed %d connections that %s since the last such line (the last from %s; %d "
                        "open, limit %d; at most a line a minute: "
                        "dq_gateway_connections_closed_total{reason=%r} counts each)", count, REASONS[reason][2],
                        peer, len(self.open), self.limits.max_connections, reason)


class GuardedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bounded head in size and time, and a place among ``connections``."""

    guard: Connections  # set by Connections.protocol (uvicorn's own ``connections`` is the server's set)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.heading, self.head_bytes, self.head_tail = True, 0, b""
        self.idle_since: float | None = None
        self.head_timer: asyncio.TimerHandle | None = None
        self.head_since: float | None = time.monotonic()  # a head is awaited since (None: not now)
        if not self.guard.opened(self):
            self.refuse("over_limit")
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.guard.lost(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.idle_since = None
        if self.heading:
            if self.head_timer is None:  # the first byte of a request after the previous one
                self._arm()
            seen, limit = self.head_bytes, self.guard.limits.max_header_bytes
            self.head_bytes += len(data)
            if self.head_bytes > limit:  # unless the head ends within the limit (a body may follow in this read)
                window = self.head_tail + data[: max(0, limit - seen)]
                if not any(end in window for end in HEAD_ENDS):
                    self.refuse("header_too_large")
                    return
            self.head_tail = data[-3:]
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self.heading = False
        self._disarm()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.heading, self.head_bytes, self.head_tail = True, 0, b""  # the next request's head, from its first byte

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.pipeline and not self.transport.is_closing():
            self.idle_since = time.monotonic()

    def send_400_response(self, msg: str) -> None:
        self.guard.count("invalid_request", self.client)
        super().send_400_response(msg)

    def close_idle(self) -> None:
        self.guard.count("idle_evicted", self.client)
        self.transport.close()

    def _arm(self) -> None:
        self.head_since = time.monotonic()
        self.head_timer = self.loop.call_later(self.guard.limits.header_timeout_s, self._head_late)

    def _disarm(self) -> None:
        self.head_since = None
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_late(self) -> None:
        self.head_timer = None
        if self.heading and not self.transport.is_closing():
            self.refuse("header_timeout")

    def refuse(self, reason: str) -> None:
        """Answer with the reason's status (no request was read, so none is answered otherwise) and close."""
        self._disarm()
        self.guard.count(reason, self.client)
        status, code, what = REASONS[reason]
        body = error_body(code, f"this connection {what}: closed")
        self.transport.write(b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
        self.transport.close()
