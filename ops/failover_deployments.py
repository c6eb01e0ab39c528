"""What ops/failover.py makes fail: a primary with a replica and three sentinels on loopback (``Replicated``; a
Redis Cluster is ops/failover_cluster.py's ``Clustered``), and the CPU worker processes that serve through them
(``Worker``). Each topology's ``fail(kind)`` makes its primary fail one of its ``KINDS`` and returns the seconds until
a new primary serves.
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

from producer.local.binaries import Binary, find  # noqa: E402
from producer.local.ports import free_port  # noqa: E402
from producer.local.server import RedisServer  # noqa: E402

SERVICE = "dq"
DOWN_AFTER_MS = 1000  # the sentinels' down-after-milliseconds: a frozen primary is frozen for twice that
KINDS = ("kill", "stop", "planned")


class Replicated:
    """A primary, a replica and three sentinels on loopback, the nodes' roles followed through failovers.
    ``sentinel_password``: the sentinels require it (``requirepass``, and among themselves ``sentinel-pass``)."""

    cluster = False
    KINDS = KINDS

    def __init__(self, binary: Binary | None = None, sentinel_password: str | None = None) -> None:
        self.binary = binary or find()
        self.sentinel_password = sentinel_password
        # No sync delay (repl-diskless-sync-delay's default is 5 s on all three servers): the replica's first sync,
        # that of a killed primary restarted as a replica and that of a frozen one demoted once let go each start
        # at once, not 5 s later (the sentinels' promotion, what a failover costs, is not affected).
        nodelay = ("--repl-diskless-sync-delay", "0")
        self.nodes = [RedisServer(*nodelay, binary=self.binary)]
        self.nodes.append(RedisServer(*nodelay, "--replicaof", "127.0.0.1", str(self.nodes[0].port),
                                      binary=self.binary))
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen] = []
        self.directory = Path(tempfile.mkdtemp(prefix="dq-sentinels-"))

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + f"/{SERVICE}/0"

    def start(self) -> Replicated:
        return self.launch().settle()

    def launch(self) -> Replicated:
        """The nodes and the sentinels started; the sentinels answer at once, but know each other and the replica
        only a few seconds later (``settle``): workers started meanwhile load their model in that time."""
        for node in self.nodes:
            node.start()
        for port in self.sentinel_ports:
            conf = self.directory / f"sentinel-{port}.conf"
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {self.directory}\n"
                            f"sentinel monitor {SERVICE} 127.0.0.1 {self.nodes[0].port} 2\n"
                            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                            f"sentinel failover-timeout {SERVICE} 5000\n" + (
                                f"requirepass {self.sentinel_password}\nsentinel sentinel-pass "
                                f"{self.sentinel_password}\n" if self.sentinel_password else ""))
            log = open(self.directory / f"sentinel-{port}.log", "ab")
            self.sentinels.append(subprocess.Popen([self.binary.path, str(conf), "--sentinel"], stdout=log,
                                                   stderr=subprocess.STDOUT))
        return self

    def settle(self) -> Replicated:
        self.wait_stable()
        return self

    def sentinel(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1, decode_responses=True,
                           password=self.sentinel_password)

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

    def wait_stable(self, timeout: float = 60.0) -> RedisServer:
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
