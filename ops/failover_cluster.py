"""The Redis Cluster that ops/failover.py makes fail (``Clustered``): three primaries with a replica each on loopback,
the primary of shard 0's work streams killed in one of ``KINDS``, or shard 0's slot moved to another primary and back
(``migrate``). ops/failover_deployments.py has Sentinel's.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402
from redis.crc import key_slot  # noqa: E402

from producer.local.binaries import Binary, find  # noqa: E402
from producer.local.ports import free_port  # noqa: E402
from producer.local.server import RedisServer  # noqa: E402

SLOTS = 16384
KINDS = ("kill", "unsynced", "migrate")
SYNC_DELAY_S = 5  # repl-diskless-sync-delay's default on all three servers: how long "unsynced" has to kill
UNSYNCED_S = 1.0  # how long the primary takes writes its unsynced replica will never have, before it is killed
MIGRATE_BATCH = 10  # keys per MIGRATE: redis-cli --cluster reshard's default (--cluster-pipeline)
MIGRATE_TIMEOUT_MS = 60_000  # redis-cli's default (--cluster-timeout)


def move_slot(slot: int, source: RedisServer, target: RedisServer, primaries: list[RedisServer],
              batch: int = MIGRATE_BATCH) -> int:
    """Move ``slot`` as ``redis-cli --cluster reshard`` does; the keys moved. The target IMPORTING and the source
    MIGRATING it, its keys sent over by MIGRATE in batches of ``batch`` (no REPLACE: a key already on the target is an
    error, as there), then every primary told the target owns it (the target first, then the source). Meanwhile a
    key the source no longer has is answered ASK, and a call over several keys of which one has moved TRYAGAIN, until
    the last SETSLOT."""
    def ask(node: RedisServer, *command: object) -> Any:
        with redis.Redis(port=node.port, socket_timeout=5) as client:
            return client.execute_command(*command)

    source_id, target_id = ask(source, "CLUSTER", "MYID"), ask(target, "CLUSTER", "MYID")
    ask(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
    ask(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
    moved = 0
    with redis.Redis(port=source.port, socket_timeout=MIGRATE_TIMEOUT_MS / 1000 + 5) as client:
        while keys := client.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
            client.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, MIGRATE_TIMEOUT_MS, "KEYS", *keys)
            moved += len(keys)
    for node in [target, source, *(n for n in primaries if n not in (target, source))]:
        ask(node, "CLUSTER", "SETSLOT", slot, "NODE", target_id)
    return moved


class Clustered:
    """Redis Cluster: three primaries with one replica each on loopback. A failure kills (-9) the primary of shard
    0's work streams; the cluster promotes its replica; the old node restarts and rejoins as that one's replica.
    ``kill``: its replica in sync (``wait_stable`` waits for every replication link). ``unsynced``: its replica
    killed and restarted first, the primary killed ``UNSYNCED_S`` into the replica's first sync (held open
    ``SYNC_DELAY_S`` by the primary's ``repl-diskless-sync-delay``): the replica is promoted with only its own data,
    as when a shard fails again during a resync (docs/RELIABILITY.md). ``migrate``: nothing fails; the slot of shard
    0's keys is moved to another primary and back while the load goes on, as ``redis-cli --cluster reshard`` moves
    it (``move_slot``)."""

    cluster = True
    KINDS = KINDS

    def __init__(self, binary: Binary | None = None) -> None:
        self.binary = binary or find()
        self.buses = [free_port() for _ in range(6)]  # distinct, though none is bound before the nodes start
        # Validity factor 0: a replica stands for election however long its link has been down (as a managed
        # service may set it): what lets an unsynced one be promoted. No sync delay: a restarted node is a replica
        # in sync about a second after it answers, not six.
        self.nodes = [RedisServer("--cluster-port", str(bus), "--cluster-node-timeout", "2000",
                                  "--cluster-replica-validity-factor", "0", "--repl-diskless-sync-delay", "0",
                                  binary=self.binary, cluster=True)
                      for bus in self.buses]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def _ask(self, node: RedisServer, *command: object) -> object:
        return redis.Redis(port=node.port, socket_timeout=1, decode_responses=True).execute_command(*command)

    def start(self) -> Clustered:
        return self.launch().settle()

    def launch(self) -> Clustered:
        """The nodes started, their slots given, met, and each replica told its primary; every replica in sync only
        later (``settle``)."""
        for node in self.nodes:
            node.start()
        share = SLOTS // 3
        for i, node in enumerate(self.nodes[:3]):
            self._ask(node, "CLUSTER", "ADDSLOTSRANGE", i * share, SLOTS - 1 if i == 2 else (i + 1) * share - 1)
        for node, bus in zip(self.nodes[1:], self.buses[1:]):
            self._ask(self.nodes[0], "CLUSTER", "MEET", "127.0.0.1", node.port, bus)
        deadline = time.monotonic() + 30
        while any(len(str(self._ask(n, "CLUSTER", "NODES")).splitlines()) < 6 for n in self.nodes):
            if time.monotonic() > deadline:
                raise TimeoutError("the cluster's nodes did not meet")
            time.sleep(0.05)
        for primary, replica in zip(self.nodes[:3], self.nodes[3:]):
            self._ask(replica, "CLUSTER", "REPLICATE", self._ask(primary, "CLUSTER", "MYID"))
        return self

    def settle(self) -> Clustered:
        self.wait_stable()
        return self

    def _view(self) -> list[list[str]]:
        """CLUSTER NODES of a live node, one split line per node."""
        for node in self.nodes:
            try:
                return [line.split() for line in str(self._ask(node, "CLUSTER", "NODES")).splitlines()]
            except redis.RedisError:
                continue
        raise redis.ConnectionError("no node answers")

    def wait_stable(self, timeout: float = 60.0) -> RedisServer:
        """Wait until every node says ``cluster_state:ok`` and each of the three primaries has a replica in sync:
        its cluster bus link ``connected`` (CLUSTER NODES) and its replication link up, the first sync done (INFO).
        The bus link alone is up seconds before a restarted node has any data: a kill then rolled the shard back."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                view = self._view()
                primaries = [row for row in view if "master" in row[2] and "fail" not in row[2] and len(row) > 8]
                replicas = [row for row in view if "slave" in row[2] and "fail" not in row[2] and row[7] == "connected"]
                ok = all("cluster_state:ok" in str(self._ask(n, "CLUSTER", "INFO")) for n in self.nodes)
                if ok and len(primaries) == 3 and {r[3] for r in replicas} >= {p[0] for p in primaries} \
                        and all(self._synced(node) for node in self.nodes):
                    return self.owner()
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise TimeoutError("the cluster did not become stable")

    def _synced(self, node: RedisServer) -> bool:
        """A primary, or a replica whose replication link is up and not in a full sync."""
        info = redis.Redis(port=node.port, socket_timeout=1, decode_responses=True).info("replication")
        return info.get("role") == "master" or (info.get("master_link_status") == "up"
                                                and not int(info.get("master_sync_in_progress", 1)))

    def _unsync(self, primary: RedisServer) -> None:
        """Kill (-9) and restart ``primary``'s replica; return once it follows it again, inside the first sync
        (which the primary delays ``SYNC_DELAY_S``)."""
        rows = self._view()
        me = next(row[0] for row in rows if f":{primary.port}@" in row[1])
        replica = next(n for n in self.nodes for row in rows if row[3] == me and f":{n.port}@" in row[1])
        self._ask(primary, "CONFIG", "SET", "repl-diskless-sync-delay", SYNC_DELAY_S)
        replica.stop(kill=True)
        replica.start()
        deadline = time.monotonic() + 10
        while (info := redis.Redis(port=replica.port, decode_responses=True).info("replication")).get(
                "master_port") != primary.port and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(UNSYNCED_S)
        info = redis.Redis(port=replica.port, decode_responses=True).info("replication")
        if info.get("master_port") != primary.port or info.get("master_link_status") == "up":
            raise RuntimeError(f"the restarted replica is not in its first sync: {info}")

    def owner(self) -> RedisServer:
        """The primary of shard 0's work streams' slot."""
        slot = key_slot(b"{s0}")
        for row in self._view():
            if "master" in row[2] and "fail" not in row[2]:
                for part in row[8:]:
                    low, _, high = part.partition("-")
                    if part[0] != "[" and int(low) <= slot <= int(high or low):
                        return next(n for n in self.nodes if f":{n.port}@" in row[1])
        raise LookupError("no primary owns shard 0")

    def fail(self, kind: str) -> float:
        if kind == "migrate":
            return self.migrate()
        old = self.owner()
        if kind == "unsynced":
            self._unsync(old)
        start = time.monotonic()
        old.stop(kill=True)
        while time.monotonic() - start < 30:
            try:
                if self.owner() is not old:
                    break
            except (LookupError, redis.RedisError):
                pass
            time.sleep(0.05)
        took = time.monotonic() - start
        old.start()  # its nodes.conf names the cluster: it rejoins as the promoted node's replica
        self.wait_stable()
        return took

    def migrate(self) -> float:
        """Shard 0's slot moved to another primary and back under load; the seconds both moves took."""
        start, slot, home = time.monotonic(), key_slot(b"{s0}"), self.owner()
        away = next(node for node in self._primaries() if node is not home)
        move_slot(slot, home, away, self._primaries())
        move_slot(slot, away, home, self._primaries())
        return time.monotonic() - start

    def _primaries(self) -> list[RedisServer]:
        rows = [row for row in self._view() if "master" in row[2] and "fail" not in row[2]]
        return [node for row in rows for node in self.nodes if f":{node.port}@" in row[1]]

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.wait_stable().port)

    def close(self) -> None:
        for node in self.nodes:
            node.__exit__()
