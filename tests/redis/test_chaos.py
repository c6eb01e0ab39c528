"""Chaos, bounded in time, on each supported server: two worker processes serving both lanes, fan-out and reply
streams, while connections are killed at random, a worker is killed (-9) and replaced, and Redis is killed and
restarted from its AOF. Then the invariant (exactly one result per request, nothing pending) and what it does not
count: no dead letter but the poison's, every reply exactly once, reply and dead-letter streams within their caps.
Ordinary faults must never change an answer (docs/RELIABILITY.md)."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest
import redis

from faults import FANOUT, FAULTY, batch, long_request, wait_for
from producer.client import Client
from producer.admin.audit import wait_and_check
from producer.wire.keys import Field
from producer.wire.result import Result

pytestmark = [pytest.mark.redis, pytest.mark.slow]

POISON = "POISON-c4a0"
WORKER = dict(claim_idle_ms=1500, max_deliveries=4, reply_maxlen=1000, entry=FAULTY, env={"DQ_FAULT_RAISE": POISON},
              **FANOUT)


def test_chaos_never_changes_an_answer(redis_server, start_worker, tiny_dir):
    client = Client(redis_server.url, max_unfinished=0)
    keys, reply = client.keys, client.keys.reply_prefix + "chaos"
    workers = [start_worker(tiny_dir, redis_server.url, ready=False, **WORKER) for _ in range(2)]
    for worker in workers:
        worker.wait_ready()
    rng = random.Random(7)
    requests = [{**request, "reply_to": reply, **({"priority": "high"} if n % 3 == 0 else {})}
                for n, request in enumerate(batch(240, "chaos"))]
    for k in range(6):  # fanned out into parts, one in each lane's part stream at least
        requests.insert(40 * k + 7, {**long_request(f"chaos-long-{k}"), "reply_to": reply,
                                     **({"priority": "high"} if k % 2 else {})})
    requests.insert(100, {"id": "poison", "state": f"It carries {POISON}.", "reply_to": reply,
                          "questions": {"q": {"type": "noul"}}})
    submitted: list[str] = []
    stop = threading.Event()

    def produce() -> None:  # waves of submissions through every fault (the client reconnects and retries)
        for start in range(0, len(requests), 16):
            submitted.extend(client.submit_many(requests[start: start + 16]))
            time.sleep(0.1)

    def kill_connections() -> None:
        admin = redis.Redis.from_url(redis_server.url)
        while not stop.wait(rng.uniform(0.3, 0.9)):
            try:
                admin.client_kill_filter(_type="normal", skipme=True)
            except (redis.ConnectionError, redis.ResponseError):
                pass  # Redis is restarting

    producer, killer = threading.Thread(target=produce), threading.Thread(target=kill_connections)
    producer.start()
    killer.start()
    try:
        wait_for(lambda: len(submitted) >= 60, 60, what="the first waves")
        workers[0].process.kill()  # a worker dies holding entries; another takes its place
        workers.append(start_worker(tiny_dir, redis_server.url, ready=False, **WORKER))
        wait_for(lambda: len(submitted) >= 150, 90, what="more waves")
        redis_server.stop(kill=True)  # what was acknowledged is in the AOF (fsync always)
        time.sleep(1.0)
        redis_server.start()
        producer.join(120)
    finally:
        stop.set()
        killer.join(10)
    assert not producer.is_alive() and len(submitted) == len(requests)
    report = wait_and_check(client.redis, keys, submitted, timeout=180).assert_ok()

    results = report.results
    assert results["poison"].error.code.value == "dead_lettered"
    wrong = {i: r.error.code.value for i, r in results.items() if i != "poison" and not r.ok}
    assert not wrong, wrong  # no valid request dead-lettered or failed by a fault
    assert all(results[f"chaos-long-{k}"].usage.parts > 1 for k in range(6))
    dead = client.redis.xrange(keys.dead)
    assert [fields[Field.ENTRY_ID.encode()] for _, fields in dead] and all(
        b"POISON" in fields.get(Field.BODY.encode(), b"") for _, fields in dead)  # the poison, nothing else
    # Once each: a request the client's retry enqueued twice is answered twice, the second time as a replay.
    answers = [Result.model_validate_json(fields[Field.BODY.encode()]) for _, fields in client.redis.xrange(reply)]
    replies = Counter(answer.id for answer in answers if not answer.replay)
    assert set(replies) == set(submitted) and set(replies.values()) == {1}, replies.most_common(3)
    assert client.redis.xlen(reply) <= 1000 + 100 and client.redis.xlen(keys.dead) < 10  # within their caps
    memory = client.redis.info("memory")["used_memory_human"]
    print(f"\nchaos: {len(submitted)} requests, {sum(not r.ok for r in results.values())} errors (the poison), "
          f"{len(dead)} dead letters, {sum(replies.values())} replies to {len(replies)} ids, "
          f"{len(answers) - sum(replies.values())} replays, left undrained {sum(report.leftovers.values())}, "
          f"reply stream {client.redis.xlen(reply)}, Redis used memory {memory}")
