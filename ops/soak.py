"""Soak: producers submit System One requests to a running deployment for a bounded time; then the queue's invariant
is checked (producer/admin/audit.py): every request has exactly one result, none lost, none duplicated, and the
queue drained. Prints throughput and latency; exits 1 if the invariant does not hold.

    python ops/soak.py --redis redis://redis:6379/0 --namespace dq --requests 200000 --producers 8 --duration 900

It only talks to Redis (the workers must already serve ``--namespace``). A small share of the requests is bad on
purpose (``--bad-fraction``) and must come back as ``invalid_request``. Give the soak a namespace of its own, or
pass ``--no-drain-check`` when other traffic shares the streams. tests/redis/test_soak.py runs the same code on CPU
workers in CI.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from producer.client import Client, QueueFull  # noqa: E402
from producer.admin.audit import Report, wait_and_check  # noqa: E402
from producer.wire.keys import Field, Keys, shard_of  # noqa: E402

QUESTIONS = [
    {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    {"type": "choice", "instructions": "What is the tone?", "criteria": {"calm": "polite", "angry": None,
                                                                        "pushy": "pressure"}},
    {"type": "score", "instructions": "How urgent is it?", "criteria": ["can wait", "this week", "today"]},
]
WORDS = "refund order parcel damaged charged twice please help today account login invoice late".split()


@dataclass
class Soak:
    """What was sent, and what came back."""

    good: list[str] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)  # must be answered invalid_request
    submit_seconds: float = 0.0
    total_seconds: float = 0.0
    queue_full: int = 0  # batches refused by backpressure (and sent again)
    report: Report | None = None

    @property
    def ids(self) -> list[str]:
        return self.good + self.bad

    def problems(self) -> list[str]:
        out = self.report.problems() if self.report else ["not checked"]
        if self.report:
            wrong = [i for i in self.good if i in self.report.results and not self.report.results[i].ok]
            wrong += [i for i in self.bad if i in self.report.results
                      and (self.report.results[i].ok or self.report.results[i].error.code.value != "invalid_request")]
            if wrong:
                out.append(f"{len(wrong)} results with the wrong status (e.g. {wrong[:5]})")
        return out

    def stats(self) -> dict:
        results = self.report.results.values() if self.report else []
        timed = [r.timings for r in results if r.timings and r.timings.enqueued_ms and r.timings.finished_ms]
        latencies = sorted((t.finished_ms - t.enqueued_ms) / 1000 for t in timed)
        span = (max(t.finished_ms for t in timed) - min(t.enqueued_ms for t in timed)) / 1000 if timed else 0.0

        def pick(q: float) -> float | None:
            return round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 3) if latencies else None

        return {"submitted": len(self.ids), "answered": len(results), "bad": len(self.bad),
                "statuses": dict(self.report.statuses) if self.report else {},
                "requests_per_s": round(len(results) / span, 1) if span else None,
                "latency_s": {"p50": pick(0.5), "p95": pick(0.95), "p99": pick(0.99)},
                "submit_s": round(self.submit_seconds, 1), "total_s": round(self.total_seconds, 1),
                "queue_full": self.queue_full, "problems": self.problems()}


def request(request_id: str, rng: random.Random) -> dict:
    count = rng.randint(1, 3)
    state = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))
    return {"id": request_id, "state": state, "questions": {f"q{k}": QUESTIONS[k] for k in range(count)}}


def produce(client: Client, soak: Soak, lock: threading.Lock, prefix: str, until: float, quota: list[int],
            batch: int, bad_fraction: float, seed: int) -> None:
    rng = random.Random(seed)
    n = 0
    while time.monotonic() < until:
        with lock:
            take = min(batch, quota[0])
            quota[0] -= take
        if take <= 0:
            return
        good, bad = [], []
        for _ in range(take):
            n += 1
            (bad if rng.random() < bad_fraction else good).append(f"{prefix}-{n}")
        requests = [request(i, rng) for i in good]
        while requests:
            try:
                client.submit_many(requests)
                break
            except QueueFull as full:  # backpressure: the workers are behind; wait and send what did not go in
                refused = set(full.refused)
                requests = [r for r in requests if r["id"] in refused]
                with lock:
                    soak.queue_full += 1
                time.sleep(0.05)
        for request_id in bad:  # a plain XADD, as a producer in another language would send it
            body = {"id": request_id, "state": "x", "questions": {"q": {"type": "no-such-type"}}}
            keys = Keys(client.keys.namespace, shard_of(request_id, client.shards))
            client.redis.xadd(keys.requests, {Field.BODY: json.dumps(body)})
        with lock:
            soak.good += good
            soak.bad += bad


def run(url: str, requests: int = 10_000, producers: int = 4, duration: float = 60.0, namespace: str = "dq",
        shards: int = 1, batch: int = 20, bad_fraction: float = 0.01, max_unfinished: int = 2000,
        timeout: float = 300.0, drained: bool = True, cluster: bool = False, seed: int = 0,
        log=print) -> Soak:
    """Submit up to ``requests`` over at most ``duration`` seconds from ``producers`` threads, then check."""
    soak, lock = Soak(), threading.Lock()
    run_id = uuid.uuid4().hex[:8]
    clients = [Client(url, namespace, max_unfinished=max_unfinished, cluster=cluster, shards=shards)
               for _ in range(producers)]
    start = time.monotonic()
    quota = [requests]
    threads = [threading.Thread(target=produce, args=(c, soak, lock, f"soak-{run_id}-{p}", start + duration, quota,
                                                      batch, bad_fraction, seed + p)) for p, c in enumerate(clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        for t in threads:
            t.join(timeout=5 / len(threads))
        log(f"soak: {len(soak.ids)} submitted after {time.monotonic() - start:.0f} s")
    soak.submit_seconds = time.monotonic() - start
    soak.report = wait_and_check(clients[0].redis, clients[0].keys, soak.ids, timeout=timeout, drained=drained,
                         shards=shards)
    soak.total_seconds = time.monotonic() - start
    for c in clients:
        c.close()
    return soak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python ops/soak.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0", help="Redis URL of the deployment")
    parser.add_argument("--namespace", default="dq", help="the namespace the workers serve")
    parser.add_argument("--requests", type=int, default=10_000, help="requests to submit at most")
    parser.add_argument("--producers", type=int, default=4, help="producer threads, each with its own connection")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of submitting at most")
    parser.add_argument("--shards", type=int, default=1, help="stream shards of the deployment")
    parser.add_argument("--batch", type=int, default=20, help="requests per submit call")
    parser.add_argument("--bad-fraction", type=float, default=0.01, help="share of invalid requests")
    parser.add_argument("--max-unfinished", type=int, default=2000, help="producer backpressure limit")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the last results")
    parser.add_argument("--no-drain-check", action="store_true", help="other traffic shares the streams")
    parser.add_argument("--cluster", action="store_true", help="Redis Cluster")
    args = parser.parse_args(argv)
    soak = run(args.redis, args.requests, args.producers, args.duration, args.namespace, args.shards, args.batch,
               args.bad_fraction, args.max_unfinished, args.timeout, not args.no_drain_check, args.cluster)
    stats = soak.stats()
    print(json.dumps(stats, indent=2))
    print(f"soak: {soak.report.summary()}")
    return 1 if stats["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
