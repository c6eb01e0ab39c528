"""What ops/failover.py's producers do and what its checker counts, Jepsen-style: closed-loop producers that
submit requests with ids and read their results (``produce``), every acknowledgement and result read recorded in a
``Run``; then, from the final primary, what was lost, read and then lost or changed, and left pending (``check``).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402

from producer.admin.audit import leftovers  # noqa: E402
from producer.client import Client, NotDurable, ResultTimeout  # noqa: E402
from producer.wire.keys import Field, Keys  # noqa: E402
from producer.wire.result import Result  # noqa: E402

# commands per request (set: on Redis Cluster in durable mode, a reader's mark after its reads)
COUNTED = ("fcall", "wait", "publish", "set", "xread", "xrange", "xreadgroup", "xack", "xdel")
RESULT_WAIT_S = 60.0  # how long a producer waits for a batch's results before it moves on


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
    answered_error: dict[str, int] = field(default_factory=dict)  # error code -> acknowledged requests answered so
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
                "changed": self.changed, "pending": self.pending, "answered_error": self.answered_error,
                "workers_down": self.workers_down,
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
    for bodies in final.values():  # every request here is valid: an error result is the queue's failure
        if bodies and (code := (json.loads(bodies[0]).get("error") or {}).get("code")):
            run.answered_error[code] = run.answered_error.get(code, 0) + 1
    for request_id, seen in run.read.items():
        now = [Result.model_validate_json(body).model_dump_json() for body in final.get(request_id) or []]
        if now[:1] != [seen]:
            run.read_lost += 1
            if now and answer(now[0]) != answer(seen):
                run.changed += 1
                run.examples.append({"read": json.loads(seen), "now": json.loads(now[0])})
        run.changed += len({answer(body) for body in now}) > 1


def commandstats(primary: redis.Redis | redis.RedisCluster) -> dict[str, int]:
    """Calls of each command since the server started; on a cluster, summed over its primaries."""
    if not isinstance(primary, redis.RedisCluster):
        return {name.removeprefix("cmdstat_"): int(value["calls"])
                for name, value in primary.info("commandstats").items()}
    total: dict[str, int] = {}
    for node in primary.get_primaries():
        for name, calls in commandstats(primary.get_redis_connection(node)).items():
            total[name] = total.get(name, 0) + calls
    return total
