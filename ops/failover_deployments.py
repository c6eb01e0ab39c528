"""What ops/failover.py makes fail: a primary with a replica and three sentinels on loopback (``Replicated``), a
Redis Cluster of primaries with a replica each (``Clustered``), and the CPU worker processes that serve through them
(``Worker``). Each topology's ``fail(kind)`` makes its primary fail one of ``KINDS`` and returns the seconds until a
new primary serves.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
from redis.crc import key_slot  # noqa: E402

from producer.local.binaries import Binary, find  # noqa: E402
from producer.local.ports import free_port  # noqa: E402
from producer.local.server import RedisServer  # noqa: E402

SERVICE = "dq"
SLOTS = 16384
DOWN_AFTER_MS = 1000  # the sentinels' down-after-milliseconds: a frozen primary is frozen for twice that
KINDS = ("kill", "stop", "planned")


class Replicated:
    """A primary, a replica and three sentinels on loopback, the nodes' roles followed through failovers."""

    cluster = False

    def __init__(self, binary: Binary | None = None) -> None:
        self.binary = binary or find()
        self.nodes = [RedisServer(binary=self.binary)]
        self.nodes.append(RedisServer("--replicaof", "127.0.0.1", str(self.nodes[0].port), binary=self.binary))
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen] = []
        self.directory = Path(tempfile.mkdtemp(prefix="dq-sentinels-"))

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + f"/{SERVICE}/0"

    def start(self) -> Replicated:
        for node in self.nodes:
            node.start()
        for port in self.sentinel_ports:
            conf = self.directory / f"sentinel-{port}.conf"
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {self.directory}\n"
                            f"sentinel monitor {SERVICE} 127.0.0.1 {self.nodes[0].port} 2\n"
                            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                            f"sentinel failover-timeout {SERVICE} 5000\n")
            log = open(self.directory / f"sentinel-{port}.log", "ab")
            self.sentinels.append(subprocess.Popen([self.binary.path, str(conf), "--sentinel"], stdout=log,
                                                   stderr=subprocess.STDOUT))
        self.wait_stable(initial=True)
        return self

    def sentinel(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1, decode_responses=True)

    def primary(self) -> RedisServer:
        """The node every sentinel names as the primary (waits until they agree)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                ports = {int(self.sentinel(p).sentinel_get_master_addr_by_name(SERVICE)[1])
                         for p in self.sentinel_ports}
            except (redis.RedisError, TypeError):
                ports = set()
            if len(ports) == 1:
                return next(n for n in self.nodes if n.port in ports)
            time.sleep(0.05)
        raise TimeoutError("the sentinels do not agree on a primary")

    def wait_stable(self, initial: bool = False, timeout: float = 60.0) -> RedisServer:
        """Wait until one node is the primary by every sentinel and its own word, the other its replica in sync,
        and the sentinels know both (so that the next failure can fail over)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                primary = self.primary()
                other = next(n for n in self.nodes if n is not primary)
                role = redis.Redis(port=primary.port, socket_timeout=1).execute_command("ROLE")
                replica = redis.Redis(port=other.port, socket_timeout=1).info("replication")
                known = all(int(self.sentinel(p).sentinel_master(SERVICE)["num-slaves"]) >= 1 and
                            int(self.sentinel(p).sentinel_master(SERVICE)["num-other-sentinels"]) == 2
                            for p in self.sentinel_ports)
                if (role[0] == b"master" and role[2] and replica.get("master_link_status") == "up"
                        and replica.get("master_port") == primary.port and known):
                    return primary
            except (redis.RedisError, StopIteration):
                pass
            time.sleep(0.1)
        raise TimeoutError("the primary and its replica did not become stable")

    def fail(self, kind: str) -> float:
        """One failure of the primary; returns the seconds until the sentinels named another one."""
        old = self.primary()
        start = time.monotonic()
        if kind == "kill":
            old.stop(kill=True)
        elif kind == "stop":
            old.pause()
        elif kind == "planned":
            self.sentinel(self.sentinel_ports[0]).execute_command("SENTINEL", "FAILOVER", SERVICE)
        while self.primary() is old and time.monotonic() - start < 30:
            time.sleep(0.02)
        took = time.monotonic() - start
        if kind == "stop":
            time.sleep(max(0.0, 2 * DOWN_AFTER_MS / 1000 - took))  # frozen past the down-after time
            old.resume()
        elif kind == "kill":  # from its AOF, as the new primary's replica (as a node whose configuration the
            # sentinels rewrote would restart: these have no file, and one restarted a primary waits ~10 s for them)
            kept = [arg for i, arg in enumerate(old.args) if "--replicaof" not in old.args[max(0, i - 2): i + 1]]
            old.args = [*kept, "--replicaof", "127.0.0.1", str(self.primary().port)]
            old.start()
        self.wait_stable()
        return took

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.wait_stable().port)

    def close(self) -> None:
        for process in self.sentinels:
            process.kill()
            process.wait(10)
        for node in self.nodes:
            if node.process is not None:
                node.resume()
            node.__exit__()
        shutil.rmtree(self.directory, ignore_errors=True)


class Clustered:
    """Redis Cluster: three primaries with one replica each on loopback. A failure kills (-9) the primary of shard
    0's work streams; the cluster promotes its replica; the old node restarts and rejoins as that one's replica."""

    cluster = True

    def __init__(self, binary: Binary | None = None) -> None:
        self.binary = binary or find()
        self.buses = [free_port() for _ in range(6)]  # distinct, though none is bound before the nodes start
        # validity factor 0: a replica always stands for election (a replica of an idle primary can otherwise find
        # its data "too old" and nobody is promoted: seen here on Redis 7.0)
        self.nodes = [RedisServer("--cluster-port", str(bus), "--cluster-node-timeout", "2000",
                                  "--cluster-replica-validity-factor", "0", binary=self.binary, cluster=True)
                      for bus in self.buses]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def _ask(self, node: RedisServer, *command: object) -> object:
        return redis.Redis(port=node.port, socket_timeout=1, decode_responses=True).execute_command(*command)

    def start(self) -> Clustered:
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
        """Wait until every node says ``cluster_state:ok`` and each of the three primaries has a replica in sync."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                view = self._view()
                primaries = [row for row in view if "master" in row[2] and "fail" not in row[2] and len(row) > 8]
                replicas = [row for row in view if "slave" in row[2] and "fail" not in row[2] and row[7] == "connected"]
                ok = all("cluster_state:ok" in str(self._ask(n, "CLUSTER", "INFO")) for n in self.nodes)
                if ok and len(primaries) == 3 and {r[3] for r in replicas} >= {p[0] for p in primaries}:
                    return self.owner()
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise TimeoutError("the cluster did not become stable")

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
        old = self.owner()
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

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(host="127.0.0.1", port=self.wait_stable().port)

    def close(self) -> None:
        for node in self.nodes:
            node.__exit__()


class Worker:
    """``python -m worker serve`` against the Sentinel URL, with its health port."""

    def __init__(self, checkpoint: Path, url: str, log: Path, **settings: object) -> None:
        self.port = free_port()
        args = [sys.executable, "-m", "worker", "serve", "--checkpoint", str(checkpoint), "--redis-url", url,
                "--metrics-port", str(self.port), "--device", "cpu"]
        for name, value in settings.items():
            flag = "--" + name.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT))
        self.log = log
        self.process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout: float = 120.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            if self.ready():
                return True
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
