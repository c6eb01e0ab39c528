"""A real Redis Cluster of N primaries on loopback, joined with CLUSTER ADDSLOTSRANGE and MEET (no redis-cli).

Each node gets its own bus port (``cluster-port``, Redis 7+), so client ports above 55535 work too.
"""

from __future__ import annotations

import time

import redis
from redis.crc import key_slot

from worker.redis_server import RedisServer, free_port

SLOTS = 16384


class LocalCluster:
    def __init__(self, nodes: int = 3, *args: str, username: str | None = None, password: str | None = None) -> None:
        self.auth = {"username": username, "password": password}  # who joins the nodes (an aclfile's admin)
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
