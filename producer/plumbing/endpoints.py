"""GET endpoints in a thread of their own, ``answer(path)`` giving each reply: the small HTTP server that a
worker's ``/metrics`` and health, the launcher's and the queue exporter's endpoints share (stdlib only).

The stdlib's threaded server gives each connection a thread for as long as it stays open, and bounds neither
time nor connections: idle or half-sent connections held a thread each, for ever. Here a connection's request
must come whole within ``REQUEST_S`` and ``REQUEST_BYTES`` (a scrape or a probe sends a few hundred bytes at
once), it is closed after one answer (HTTP/1.0), and at most ``CONNECTIONS`` are served at once: one more is
closed unanswered, counted, and logged once a minute."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


REQUEST_S = 5.0  # a request's line and headers within this of its connection's start
REQUEST_BYTES = 16384  # and within these many bytes
CONNECTIONS = 32  # served at once (Prometheus, a probe, a person with curl)
LOG_EVERY_S = 60.0
log = logging.getLogger("producer.endpoints")


def http_server(host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    """A threaded HTTP server on ``host`` (an IPv4 or IPv6 address or name); ``""``: every interface, IPv6 and
    IPv4 together where the machine has IPv6, else IPv4 only. At most ``CONNECTIONS`` at once."""

    class Server(ThreadingHTTPServer):
        """Threads that do not hold the process at exit; at most ``CONNECTIONS`` served at once."""

        daemon_threads = True
        request_queue_size = 64  # the listen backlog (the stdlib's 5 dropped connects in a burst)
        serving, refused, logged = 0, 0, float("-inf")
        lock = threading.Lock()

        def process_request(self, request: Any, client_address: Any) -> None:
            with self.lock:
                full = self.serving >= CONNECTIONS
                self.serving += 0 if full else 1
                self.refused += 1 if full else 0
            if not full:
                super().process_request(request, client_address)
                return
            self.shutdown_request(request)  # no thread for it
            if time.monotonic() - self.logged >= LOG_EVERY_S:
                self.logged = time.monotonic()
                log.warning("%s:%d: %d connections closed unanswered so far: %d were open at once, the most it "
                            "serves (one line a minute)", *self.server_address[:2], self.refused, CONNECTIONS)

        def process_request_thread(self, request: Any, client_address: Any) -> None:
            try:
                super().process_request_thread(request, client_address)
            finally:
                with self.lock:
                    self.serving -= 1

        def server_bind(self) -> None:
            if self.address_family == socket.AF_INET6 and host in ("", "::"):
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual stack
            super().server_bind()

    family = socket.AF_INET
    if host in ("", "::"):
        family = socket.AF_INET6 if socket.has_ipv6 else socket.AF_INET
        host = "::" if family == socket.AF_INET6 else "0.0.0.0"
    elif ":" in host:
        family = socket.AF_INET6
    Server.address_family = family
    try:
        return Server((host, port), handler)
    except OSError as error:
        if family == socket.AF_INET6 and host == "::" and error.errno in (97, 99):  # no IPv6 configured here
            Server.address_family = socket.AF_INET
            return Server(("0.0.0.0", port), handler)
        raise


Answer = tuple[int, bytes, str]  # status, body, content type
NOT_FOUND: Answer = (404, b"not found\n", "text/plain")


def serve_paths(host: str, port: int, answer: Callable[[str], Answer], name: str = "http") -> ThreadingHTTPServer:
    """GET endpoints in a thread, ``answer(path)`` giving each reply: the exporter's, a worker's and a launcher's."""

    class Handler(BaseHTTPRequestHandler):
        """One GET, answered by ``answer(path)``; a request's head and body bounded."""

        timeout = REQUEST_S  # a socket that sends nothing for this long is closed

        def setup(self) -> None:
            super().setup()
            self.rfile = _Bounded(self.rfile)  # type: ignore[assignment]
            # A trickle of a byte a second keeps the socket's own timeout from firing: past its time the
            # request's socket is shut, which ends the read in progress.
            self.late = threading.Timer(REQUEST_S, self._late)
            self.late.start()

        def _late(self) -> None:
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def parse_request(self) -> bool:
            self.late.cancel()  # the request line and headers are in
            return super().parse_request()

        def finish(self) -> None:
            self.late.cancel()
            super().finish()

        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            code, body, kind = answer(self.path)
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # scrapes and probes are not events
            pass

    server = http_server(host, port, Handler)
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server


class _Bounded:
    """A request's input, ending (as if closed) past ``REQUEST_BYTES``."""

    def __init__(self, raw: Any) -> None:
        self.raw, self.left = raw, REQUEST_BYTES

    def readline(self, size: int = -1) -> bytes:
        if self.left <= 0:
            return b""
        line = self.raw.readline(self.left if size < 0 else min(size, self.left))
        self.left -= len(line)
        return line

    def read(self, size: int = -1) -> bytes:
        return b""  # GET endpoints read no body

    def close(self) -> None:
        self.raw.close()
