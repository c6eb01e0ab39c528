"""GET endpoints in a thread of their own, ``answer(path)`` giving each reply: the small HTTP server that a worker's
``/metrics`` and health, the launcher's and the queue exporter's endpoints share (stdlib only)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def http_server(host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    """A threaded HTTP server on ``host`` (an IPv4 or IPv6 address or name); ``""``: every interface, IPv6 and
    IPv4 together where the machine has IPv6, else IPv4 only."""

    class Server(ThreadingHTTPServer):
        daemon_threads = True

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
