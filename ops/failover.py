"""Failover: what a Redis failover under load costs the queue, counted in the style of Jepsen.

A primary, a replica and three sentinels on loopback (the server binary in sentinel mode), two CPU worker processes
and producer threads that submit requests with ids and read their results, all through a ``redis+sentinel://``
URL; the primary is made to fail under load, again and again: killed (-9) and restarted, frozen (SIGSTOP) for
longer than the sentinels' down-after time and let go, or handed over (``SENTINEL FAILOVER``). Each time the
replica is promoted and the old primary comes back as its replica. Then a checker counts, from the final primary:

- ``lost``: requests whose enqueue was acknowledged to the producer that never got a result;
- ``read_lost``: results a producer read that later vanished or were replaced (published again);
- ``changed``: of those, results whose answer changed (another probability), and ids answered twice differently;
- ``pending``: entries left in the work streams or pending in the group once the load stopped;
- ``workers``: workers that exited or were not ready again at the end (wedged).

    python ops/failover.py --failovers 20 --wait-replicas 0 1 --out failover.md    # every kind, both modes

With ``--kinds none`` (and in every full run) a run without failures measures what durability costs: throughput,
enqueue and end-to-end p50/p99 with N = 0 against N = 1, and the Redis commands per request (INFO commandstats).
tests/redis/test_failover.py runs a short version of the same code on each server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
from redis.crc import key_slot  # noqa: E402

from producer.admin.audit import leftovers  # noqa: E402
from producer.client import Client, NotDurable, ResultTimeout  # noqa: E402
from producer.local.binaries import Binary, find, probe  # noqa: E402
from producer.local.ports import free_port  # noqa: E402
from producer.local.server import RedisServer  # noqa: E402
from producer.wire.keys import Field, Keys  # noqa: E402
from producer.wire.library import REVISION_FUNCTION  # noqa: E402
from producer.wire.result import Result  # noqa: E402

SERVICE = "dq"
SLOTS = 16384
DOWN_AFTER_MS = 1000  # the sentinels' down-after-milliseconds: a frozen primary is frozen for twice that
KINDS = ("kill", "stop", "planned")
COUNTED = ("fcall", "wait", "publish", "xread", "xrange", "xreadgroup", "xack", "xdel")  # commands per request
RESULT_WAIT_S = 60.0  # how long a producer waits for a batch's results before it moves on
WORKER_FLAGS = {"claim_idle_ms": 2000, "read_count": 16, "max_inflight": 64, "max_deliveries": 50,
                "max_wait_ms": 2}


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


@dataclass
class Run:
    """One run: what producers were told and read, what the checker found."""

    kind: str
    wait_replicas: int
    cluster: bool = False
    namespace: str = "dq"
    failovers: list[float] = field(default_factory=list)  # seconds to a new primary, each
    acked: set[str] = field(default_factory=set)
    read: dict[str, str] = field(default_factory=dict)  # id -> the result JSON a producer read
    not_durable: int = 0  # NotDurable raised to producers (submits and reads)
    errors: int = 0  # other errors producers saw (connections, timeouts)
    error_kinds: dict[str, int] = field(default_factory=dict)
    enqueue_s: list[float] = field(default_factory=list)
    end_to_end_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    lost: int = 0
    read_lost: int = 0
    changed: int = 0
    pending: int = 0
    workers_down: int = 0
    commands: dict[str, float] = field(default_factory=dict)  # Redis calls per request (a run without failures)
    library: int | None = None  # the function library's revision on the final primary (replicated, not reloaded)
    examples: list[dict] = field(default_factory=list)  # results read that changed: what was read, what is there

    def saw(self, error: Exception, lock: threading.Lock) -> None:
        with lock:
            self.errors += 1
            kind = f"{type(error).__name__}: {str(error)[:60]}"
            self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1
        time.sleep(0.1)

    def row(self) -> dict:
        def pick(values: list[float], q: float) -> float | None:
            ordered = sorted(values)
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1) if ordered else None
        return {"kind": self.kind, "wait_replicas": self.wait_replicas, "failovers": len(self.failovers),
                "to_new_primary_s": round(max(self.failovers), 2) if self.failovers else None,
                "acked": len(self.acked), "lost": self.lost, "read": len(self.read), "read_lost": self.read_lost,
                "changed": self.changed, "pending": self.pending, "workers_down": self.workers_down,
                "not_durable": self.not_durable, "errors": self.errors, "error_kinds": self.error_kinds,
                "per_s": round(len(self.read) / self.seconds, 1) if self.seconds else 0.0,
                "enqueue_p50_ms": pick(self.enqueue_s, 0.5), "enqueue_p99_ms": pick(self.enqueue_s, 0.99),
                "e2e_p50_ms": pick(self.end_to_end_s, 0.5), "e2e_p99_ms": pick(self.end_to_end_s, 0.99),
                **({"commands_per_request": self.commands} if self.commands else {})}


def request(request_id: str) -> dict:
    return {"id": request_id, "state": f"Ticket {request_id}: I was charged twice, refund me please.",
            "questions": {"refund": {"type": "noul"}}}


def produce(url: str, run: Run, prefix: str, stop: threading.Event, lock: threading.Lock, batch: int) -> None:
    """Closed loop: submit a batch with ids until acknowledged (the same ids again after an error), then read its
    results; every acknowledgement and every result read is recorded for the checker."""
    client = Client(url, run.namespace, max_unfinished=0, wait_replicas=run.wait_replicas, cluster=run.cluster)
    number = 0
    while not stop.is_set():
        ids = [f"{prefix}-{number + i}" for i in range(batch)]
        number += batch
        started = time.monotonic()
        while not stop.is_set():
            try:
                client.submit_many([request(i) for i in ids])
                break
            except NotDurable:
                with lock:
                    run.not_durable += 1
            except redis.RedisError as error:
                run.saw(error, lock)
        else:
            return
        acked = time.monotonic()
        with lock:
            run.acked.update(ids)
            run.enqueue_s.append(acked - started)
        waiting = list(ids)
        give_up = time.monotonic() + RESULT_WAIT_S  # a lost request would stall this producer: the checker counts it
        while waiting and not stop.is_set() and time.monotonic() < give_up:
            try:
                found = client.wait_many(waiting, timeout=5.0)
            except ResultTimeout as timeout:
                found = timeout.results
            except NotDurable:
                with lock:
                    run.not_durable += 1
                continue
            except redis.RedisError as error:
                run.saw(error, lock)
                continue
            now = time.monotonic()
            with lock:
                for request_id, result in found.items():
                    run.read[request_id] = result.model_dump_json()
                    run.end_to_end_s.append(now - started)
            waiting = [i for i in waiting if i not in found]
    client.close()


def answer(result_json: str) -> str:
    """What a result answers: its status, error code, answers and probabilities, numbers to 6 places (a request
    computed again in another pack differs by about 1e-8: the floats are summed in another order), without when it
    was computed."""
    def rounded(value: object) -> object:
        if isinstance(value, float):
            return round(value, 6)
        if isinstance(value, dict):
            return {key: rounded(item) for key, item in value.items()}
        return [rounded(item) for item in value] if isinstance(value, list) else value

    result = json.loads(result_json)
    return json.dumps(rounded([result.get("status"), result.get("answers"), result.get("probabilities"),
                               (result.get("error") or {}).get("code")]), sort_keys=True)


def check(primary: redis.Redis, run: Run, drain_s: float) -> None:
    """Wait for the queue to drain (up to ``drain_s``), then count what was lost, changed and left."""
    keys = Keys(run.namespace)
    deadline = time.monotonic() + drain_s
    while time.monotonic() < deadline and leftovers(primary, keys):
        time.sleep(0.2)
    run.pending = sum(leftovers(primary, keys).values())
    ids = sorted(run.acked | set(run.read))
    final: dict[str, list[str]] = {}
    for start in range(0, len(ids), 1000):
        with primary.pipeline(transaction=False) as pipe:
            for request_id in ids[start: start + 1000]:
                pipe.xrange(keys.result(request_id))
            for request_id, entries in zip(ids[start: start + 1000], pipe.execute()):
                final[request_id] = [entry[Field.BODY.encode()].decode() for _, entry in entries]
    run.lost = sum(1 for i in run.acked if not final.get(i))
    for request_id, seen in run.read.items():
        now = [Result.model_validate_json(body).model_dump_json() for body in final.get(request_id) or []]
        if now[:1] != [seen]:
            run.read_lost += 1
            if now and answer(now[0]) != answer(seen):
                run.changed += 1
                run.examples.append({"read": json.loads(seen), "now": json.loads(now[0])})
        run.changed += len({answer(body) for body in now}) > 1


def commandstats(primary: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in primary.info("commandstats").items()}


def one_run(cluster: Replicated | Clustered, workers: list[Worker], kind: str, wait_replicas: int, failovers: int,
            producers: int = 4, batch: int = 5, gap_s: float = 1.5, duration_s: float = 20.0,
            drain_s: float = 60.0) -> Run:
    """Load, ``failovers`` failures of ``kind`` (``mixed``: each kind in turn; ``none``: ``duration_s`` of load
    without), then the checker."""
    run, stop, lock = Run(kind, wait_replicas, cluster.cluster), threading.Event(), threading.Lock()
    prefix = f"{kind}-{wait_replicas}-{time.time_ns()}"
    before = commandstats(cluster.client()) if kind == "none" and not cluster.cluster else {}
    threads = [threading.Thread(target=produce, args=(cluster.url, run, f"{prefix}-{p}", stop, lock, batch),
                                daemon=True) for p in range(producers)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    if kind == "none":
        time.sleep(duration_s)
    for number in range(failovers if kind != "none" else 0):
        time.sleep(gap_s)
        run.failovers.append(cluster.fail(KINDS[number % len(KINDS)] if kind == "mixed" else kind))
    time.sleep(gap_s)
    stop.set()
    for thread in threads:
        thread.join(60)
    run.seconds = time.monotonic() - started
    primary = cluster.client()
    check(primary, run, drain_s)
    revisions = primary.execute_command("FCALL", REVISION_FUNCTION, 0, **(
        {"target_nodes": redis.RedisCluster.PRIMARIES} if cluster.cluster else {}))
    run.library = min(map(int, revisions.values())) if isinstance(revisions, dict) else int(revisions)
    if before:
        after = commandstats(primary)
        run.commands = {name: round((after.get(name, 0) - before.get(name, 0)) / max(1, len(run.read)), 2)
                        for name in sorted(after) if after.get(name, 0) - before.get(name, 0) > 0
                        and not name.startswith(("info", "ping", "role", "replconf", "hello", "client", "xinfo",
                                                 "publish|", "subscribe", "sentinel"))}
    run.workers_down = sum(1 for w in workers if w.process.poll() is not None or not w.wait_ready(30))
    return run


def cost(checkpoint: Path, binary: Binary | None = None, rounds: int = 3, phase_s: float = 15.0,
         logs: Path | None = None) -> list[Run]:
    """What durability costs, in one run: one server set, two workers with ``--wait-replicas 0`` and two with 1,
    each pair on a namespace of its own, loaded in turn (``rounds`` phases of ``phase_s`` seconds each, N = 0 then
    N = 1), no failures. Returns one Run per N, the phases' figures together."""
    logs = logs or Path(tempfile.mkdtemp(prefix="dq-failover-"))
    cluster = Replicated(binary).start()
    workers = [Worker(checkpoint, cluster.url, logs / f"cost-{n}-{i}.log", wait_replicas=n, namespace=f"n{n}",
                      **WORKER_FLAGS) for n in (0, 1) for i in range(2)]
    runs = {n: Run("none", n, namespace=f"n{n}") for n in (0, 1)}
    try:
        if not all(w.wait_ready() for w in workers):
            raise RuntimeError(f"a worker did not start: see {logs}")
        for round_ in range(rounds):
            for n, run in runs.items():
                stop, lock = threading.Event(), threading.Lock()
                threads = [threading.Thread(target=produce, args=(cluster.url, run, f"c{round_}-{n}-{p}", stop, lock,
                                                                  5), daemon=True) for p in range(4)]
                started, before = time.monotonic(), commandstats(cluster.client())
                for thread in threads:
                    thread.start()
                time.sleep(phase_s)
                stop.set()
                for thread in threads:
                    thread.join(60)
                run.seconds += time.monotonic() - started
                after = commandstats(cluster.client())
                for name in COUNTED:  # the other pair idles meanwhile: its few calls are counted here too
                    run.commands[name] = run.commands.get(name, 0) + after.get(name, 0) - before.get(name, 0)
        for run in runs.values():
            check(cluster.client(), run, 60.0)
            run.commands = {name: round(calls / max(1, len(run.acked)), 2) for name, calls in run.commands.items()}
    finally:
        for worker in workers:
            worker.stop()
        cluster.close()
    return list(runs.values())


def session(checkpoint: Path, plans: list[tuple[str, int, int]], binary: Binary | None = None,
            logs: Path | None = None, clustered: bool = False, **run_options: object) -> list[Run]:
    """Servers, sentinels and two workers per durability setting; each plan (kind, wait_replicas, failovers) run
    in turn."""
    runs = []
    logs = logs or Path(tempfile.mkdtemp(prefix="dq-failover-"))
    for wait_replicas in sorted({n for _, n, _ in plans}):
        cluster = (Clustered if clustered else Replicated)(binary).start()
        extra = {"redis_cluster": True} if clustered else {"wait_replicas": wait_replicas}
        workers = [Worker(checkpoint, cluster.url, logs / f"worker-{wait_replicas}-{i}.log", **extra, **WORKER_FLAGS)
                   for i in range(2)]
        try:
            if not all(w.wait_ready() for w in workers):
                raise RuntimeError(f"a worker did not start: see {logs}")
            for kind, n, failovers in plans:
                if n == wait_replicas:
                    runs.append(one_run(cluster, workers, kind, n, failovers, **run_options))  # type: ignore[arg-type]
                    print(json.dumps(runs[-1].row()), flush=True)
        finally:
            for worker in workers:
                worker.stop()
            cluster.close()
    return runs


def table(runs: list[Run], server: str) -> str:
    columns = ["kind", "wait_replicas", "failovers", "acked", "lost", "read", "read_lost", "changed", "pending",
               "workers_down", "not_durable", "per_s", "enqueue_p50_ms", "enqueue_p99_ms", "e2e_p50_ms",
               "e2e_p99_ms"]
    lines = [f"{server}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for run in runs:
        row = run.row()
        lines.append("| " + " | ".join(str(row[c]) for c in columns) + " |")
    for run in runs:
        if run.commands:
            lines.append(f"\ncommands per request read, wait_replicas={run.wait_replicas}: {json.dumps(run.commands)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", help="redis-server or valkey-server binary (default: producer/local/binaries.py's)")
    parser.add_argument("--checkpoint", help="checkpoint directory (default: a tiny random one, written here)")
    parser.add_argument("--failovers", type=int, default=20, help="failures of each kind per run [20]")
    parser.add_argument("--kinds", nargs="+", default=["none", *KINDS], choices=["none", *KINDS])
    parser.add_argument("--wait-replicas", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of the run without failures [30]")
    parser.add_argument("--out", help="append the table (Markdown) to this file")
    parser.add_argument("--cost", action="store_true",
                        help="only what durability costs: N = 0 and N = 1 in turn on one server set, no failures")
    parser.add_argument("--cluster", action="store_true",
                        help="Redis Cluster (3 primaries, a replica each) instead of Sentinel: kill -9 only, "
                             "--wait-replicas 0 only (durable mode is not supported on Cluster)")
    args = parser.parse_args(argv)
    binary = probe(args.server) if args.server else None
    checkpoint = Path(args.checkpoint) if args.checkpoint else Path(tempfile.mkdtemp(prefix="dq-tiny-")) / "tiny"
    if not args.checkpoint:
        subprocess.run([sys.executable, "-m", "worker", "tiny-checkpoint", str(checkpoint)], cwd=ROOT, check=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL)
    plans = [(kind, n, args.failovers) for n in args.wait_replicas for kind in args.kinds]
    if args.cluster:
        plans = [("kill", 0, args.failovers)]
    runs = cost(checkpoint, binary) if args.cost else session(checkpoint, plans, binary, clustered=args.cluster,
                                                              duration_s=args.duration)
    text = table(runs, f"{(binary or find()).label}{', Redis Cluster' if args.cluster else ', Sentinel'}, "
                       f"{time.strftime('%Y-%m-%d')}, `python ops/failover.py {' '.join(sys.argv[1:])}`")
    print(text)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as out:
            out.write(text + "\n")
    durable = [r for r in runs if r.wait_replicas > 0]
    return 1 if any(r.lost or r.read_lost or r.changed or r.pending or r.workers_down for r in durable) else 0


if __name__ == "__main__":
    sys.exit(main())
