"""A real server (``redis-server`` or ``valkey-server``, binaries.py's choice) on a free loopback port, or a
real Redis Cluster of several: for the demo, the tests and the benchmarks.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis
from redis.crc import key_slot

from .binaries import Binary, find
from .ports import free_port

class RedisServer:
    """A server process on 127.0.0.1 (``binary``: this one rather than ``find()``'s); ``stop``/``start`` keep
    the port and the data directory. ``detached``: in a session of its own, so that a terminal's Ctrl-C
    reaches only the program that started it, which stops it in its turn (ops/stack.py)."""

    def __init__(self, *args: str, port: int | None = None, appendonly: bool = True, directory: str | None = None,
                 cluster: bool = False, binary: Binary | None = None, detached: bool = False) -> None:
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
        self.detached = detached
        self.server = self.found.server
        self.version = self.server.version

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def answers(self) -> bool:
        """One readiness probe: a PING over plain TCP (NOAUTH: a server whose default user is off, ops/redis_acl.py)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith((b"+PONG", b"-NOAUTH"))

    def start(self, timeout: float = 10.0) -> RedisServer:
        log = open(self.directory / "redis.log", "ab")
        self.process = subprocess.Popen([self.binary, *self.args], stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=self.detached)
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
    """A real Redis Cluster of N primaries on loopback, joined with CLUSTER ADDSLOTSRANGE and MEET (no
    redis-cli); each node has its own bus port (``cluster-port``, Redis 7+), so client ports above 55535 work
    too. For the cluster tests and the sharded scaling benchmark. ``replicas``: that many replicas of each
    primary (``nodes`` holds the primaries, ``replicas`` theirs, in order), in sync when ``start`` returns; a
    replica's first sync is not delayed (``repl-diskless-sync-delay 0``, as in
    ops/failover_deployments.py)."""

    def __init__(self, nodes: int = 3, *args: str, username: str | None = None, password: str | None = None,
                 replicas: int = 0) -> None:
        self.auth = {"username": username, "password": password}  # who joins the nodes (an aclfile's admin)
        # Every node's port and bus port are picked before any node binds one: free_port never hands one out twice.
        self.buses = [free_port() for _ in range(nodes * (1 + replicas))]
        everyone = [RedisServer("--cluster-port", str(bus), "--cluster-node-timeout", "2000",
                                *(("--repl-diskless-sync-delay", "0") if replicas else ()), *args, cluster=True)
                    for bus in self.buses]
        self.nodes, self.replicas = everyone[:nodes], everyone[nodes:]

    @property
    def url(self) -> str:
        """Any node's URL is a cluster client's entry point."""
        return self.nodes[0].url

    def start(self, timeout: float = 30.0) -> LocalCluster:
        everyone = self.nodes + self.replicas
        for node in everyone:
            node.start()
        clients = [redis.Redis(port=node.port, **self.auth) for node in everyone]
        try:
            share = SLOTS // len(self.nodes)
            for i, client in enumerate(clients[:len(self.nodes)]):
                last = SLOTS - 1 if i == len(self.nodes) - 1 else (i + 1) * share - 1
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * share, last)
            for node, bus in zip(everyone[1:], self.buses[1:]):
                clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, bus)
            deadline = time.monotonic() + timeout
            # Every node must see the whole slot map before a client's first CLUSTER SLOTS.
            while not all(b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO")
                          and len(c.execute_command("CLUSTER", "NODES").splitlines()) == len(clients)
                          for c in clients):
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster did not reach cluster_state:ok")
                time.sleep(0.05)
            for index, client in enumerate(clients[len(self.nodes):]):
                primary = clients[index % len(self.nodes)].execute_command("CLUSTER", "MYID")
                client.execute_command("CLUSTER", "REPLICATE", primary)
            while not all(c.info("replication").get("master_link_status") == "up" for c in clients[len(self.nodes):]):
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster's replicas did not sync")
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
        for node in self.nodes + self.replicas:
            node.__exit__()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
