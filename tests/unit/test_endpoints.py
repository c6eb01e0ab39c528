"""The worker's HTTP endpoints: bound where --metrics-host says (IPv4, IPv6, or both by default), /health beside
/healthz, and a log line saying where they are served."""

import logging
import socket
import time
import urllib.request
from types import SimpleNamespace

import pytest

from producer.local.ports import free_port
from worker.health import Snapshot, serve_http
from worker.metrics import Metrics


class Daemon:
    def __init__(self, host: str = "") -> None:
        self.metrics, self.settings = Metrics(), SimpleNamespace(metrics_host=host)

    def snapshot(self) -> Snapshot:
        now = time.time()
        return Snapshot(beats={"reader": now, "gpu": now}, reading_since=None, loop_running=True, redis_ok=True,
                        library_ok=True, ready=True, inflight=0, stopping=False, block_ms=1000)


def get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return reply.status


def ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_endpoints_answer_on_ipv4_and_ipv6_by_default_with_a_health_alias_and_say_where(caplog):
    port = free_port()
    with caplog.at_level(logging.INFO, logger="worker"):
        server = serve_http(Daemon(), port)
    try:
        for path in ("/healthz", "/health", "/readyz", "/metrics"):
            assert get(f"http://127.0.0.1:{port}{path}") == 200, path
        if ipv6():
            assert get(f"http://[::1]:{port}/health") == 200
        assert f"serving /metrics, /healthz (/health) and /readyz on port {port} of every interface" in caplog.text
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_host_binds_one_address():
    port = free_port()
    server = serve_http(Daemon("127.0.0.1"), port, "127.0.0.1")
    try:
        assert get(f"http://127.0.0.1:{port}/healthz") == 200
        if ipv6():
            with pytest.raises(OSError):
                get(f"http://[::1]:{port}/healthz")
    finally:
        server.shutdown()
        server.server_close()


def test_idle_trickling_and_surplus_connections_hold_no_thread_for_long(monkeypatch):
    """The stdlib's threaded server kept a thread per open connection, for ever: silent and trickling connections
    (a byte every 0.2 s) are closed within the request's time, at most CONNECTIONS are served at once (the rest
    closed unanswered, at once), and it answers afterwards."""
    import threading

    from producer.plumbing import endpoints

    monkeypatch.setattr(endpoints, "REQUEST_S", 2.0)
    server = endpoints.serve_paths("127.0.0.1", free_port(), lambda path: (200, b"ok\n", "text/plain"))
    port, base = server.server_address[1], threading.active_count()

    def closed_after(sock: socket.socket) -> float:
        started = time.monotonic()
        try:
            while sock.recv(1000):  # an answer to what it sent by its time, if any, then closed
                pass
        except ConnectionResetError:
            pass
        return time.monotonic() - started

    try:
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(endpoints.CONNECTIONS + 18)]
        time.sleep(0.3)
        assert threading.active_count() - base <= 2 * endpoints.CONNECTIONS  # a thread and its timer each
        assert max(closed_after(sock) for sock in silent[endpoints.CONNECTIONS:]) < 1  # beyond the cap: at once
        assert max(closed_after(sock) for sock in silent[: endpoints.CONNECTIONS]) < 4  # within it: past 2 s

        trickling = socket.create_connection(("127.0.0.1", port), timeout=10)
        stop = threading.Event()

        def trickle() -> None:
            try:
                for byte in b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"y" * 100:
                    if stop.is_set():
                        return
                    trickling.sendall(bytes([byte]))
                    time.sleep(0.2)
            except OSError:
                pass

        sender = threading.Thread(target=trickle)
        sender.start()
        assert closed_after(trickling) < 4
        stop.set()
        sender.join()
        assert get(f"http://127.0.0.1:{port}/metrics") == 200
    finally:
        server.shutdown()
        server.server_close()
