"""Faults, with real redis-server processes and real workers (tiny checkpoint, CPU): worker processes where the
fault is a signal (SIGTERM, SIGSTOP, kill -9) or the test reads the process's own log, else the same daemon in the
test's process (tests/redis/inprocess.py).

Every test ends with the invariant (producer/admin/audit.py): each submitted request has exactly one result, ok or
an error with a code, and the queue is drained. Faults in the forward pass come from tests/redis/faulty_worker.py:
the real daemon and model, with the engine's ``launch`` made to raise or to be slow.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import pytest
import redis

from faults import FANOUT, FAULTY, batch, long_request, wait_for, wait_log, wait_released
from producer.admin.audit import wait_and_check
from producer.client import Client
from producer.wire import library
from producer.wire.keys import NORMAL
from worker.config import Settings
from worker.loop.thread import LoopThread
from worker.metrics import Metrics

pytestmark = [pytest.mark.redis, pytest.mark.slow]

FAST_RECLAIM = dict(claim_idle_ms=1000)


def slow(seconds: float) -> dict:
    return dict(entry=FAULTY, env={"DQ_FAULT_SLOW_S": str(seconds)})


# ---------------------------------------------------------------- the forward pass fails or is slow


def test_poison_prompt_is_retried_to_the_cap_then_dead_lettered_and_its_pack_mates_answered(redis_server, inprocess):
    client = Client(redis_server.url)
    requests = batch(12, "mate")
    requests.insert(5, {"id": "poison", "state": "This one carries POISON-7f3a inside.",
                        "questions": {"q": {"type": "noul"}}})
    ids = client.submit_many(requests)  # queued before the worker starts: its first read takes them all at once
    worker = inprocess(redis_server.url, raise_on="POISON-7f3a", max_deliveries=3, max_wait_ms=300).burst()
    report = wait_and_check(client.redis, client.keys, ids, timeout=90).assert_ok()

    poison = report.results["poison"]
    assert poison.error.code.value == "dead_lettered"
    assert "3 deliveries" in poison.error.message and "injected fault" in poison.error.message
    assert all(report.results[r].ok for r in ids if r != "poison")
    shared = worker.faults.poisoned_sizes
    assert max(shared) > 1, shared  # it failed a pack that others rode in, and they were still answered
    assert shared.count(1) == 3  # bisected down to itself once per delivery: 1 + 2 retries, then the cap
    assert worker.metric("dq_retries_total") == 2 and worker.metric("dq_dead_letters_total") == 1
    [(_, dead)] = client.redis.xrange(client.keys.dead)
    assert int(dead[b"deliveries"]) == 3 and b"injected fault" in dead[b"reason"]
    assert json.loads(dead[b"body"])["id"] == "poison"  # the original entry, for an operator to look at


def test_pack_slower_than_the_claim_idle_time_is_not_stolen(redis_server, inprocess):
    client = Client(redis_server.url)
    # Packs of 3 s against a claim idle time of 1.5 s (kept alive every 375 ms: margin for a loaded CI machine).
    holder = inprocess(redis_server.url, read_count=4, max_inflight=4, claim_idle_ms=1500, slow_s=3.0).start()
    ids = client.submit_many(batch(12, "slow"))
    wait_for(lambda: holder.faults.slow_packs, what="a slow pack")
    other = inprocess(redis_server.url, claim_idle_ms=1500).start()  # reclaims anything idle over 1.5 s
    report = wait_and_check(client.redis, client.keys, ids, timeout=90).assert_ok()
    assert all(r.ok for r in report.results.values())
    assert holder.metric("dq_packs_total") >= 1  # the slow worker did answer some (packs of 3 s > 1.5 s idle)
    for worker in (holder, other):
        assert worker.metric("dq_entries_read_total", how="reclaimed") == 0
        assert worker.metric("dq_redeliveries_total") == 0


def test_sigterm_mid_pack_drains_and_leaves_nothing_to_redeliver(redis_server, start_worker, tiny_dir):
    client = Client(redis_server.url)
    first = start_worker(tiny_dir, redis_server.url, read_count=4, max_inflight=8, **slow(2.0))
    ids = client.submit_many(batch(16, "term"))
    wait_log(first, "fault: slow pack")
    first.signal(signal.SIGTERM)  # while the pack computes
    assert first.wait(60) == 0
    keys = client.keys
    assert client.redis.xpending(keys.requests, keys.group)["pending"] == 0  # nothing left half done
    answered = [r for r in ids if client.fetch(r) is not None]
    assert 0 < len(answered) < len(ids)
    second = start_worker(tiny_dir, redis_server.url)
    wait_and_check(client.redis, keys, ids, timeout=90).assert_ok()
    assert second.metric("dq_redeliveries_total") == 0 and second.metric("dq_entries_read_total") == len(ids) - len(
        answered)


# ---------------------------------------------------------------- Redis fails


def test_redis_killed_and_restarted_with_aof_workers_and_producers_carry_on(redis_server, start_worker, tiny_dir):
    workers = [start_worker(tiny_dir, redis_server.url, ready=False, claim_idle_ms=2000) for _ in range(2)]
    for worker in workers:
        worker.wait_ready()
    client = Client(redis_server.url)
    submitted: list[str] = []

    def produce():  # a producer that keeps submitting through the outage (redis-py retries reconnect it)
        for k in range(12):
            submitted.extend(client.submit_many(batch(10, f"aof{k}")))
            time.sleep(0.25)

    producer = threading.Thread(target=produce)
    producer.start()
    wait_for(lambda: len(submitted) >= 30 and client.fetch(submitted[0]), what="first results")
    redis_server.stop(kill=True)  # kill -9: what was acknowledged to a client is in the AOF (fsync always)
    time.sleep(1.0)
    redis_server.start()
    producer.join(60)
    assert not producer.is_alive() and len(submitted) == 120
    report = wait_and_check(client.redis, client.keys, submitted, timeout=120).assert_ok()
    assert all(r.ok for r in report.results.values())
    for worker in workers:
        assert worker.process.poll() is None and worker.get("/readyz")[0] == 200


def test_redis_restarted_without_persistence_recreates_the_group_and_reports_the_loss(redis_server, inprocess,
                                                                                        caplog):
    client = Client(redis_server.url)
    worker = inprocess(redis_server.url, read_count=2, max_inflight=2, slow_s=1.5, http=True, **FAST_RECLAIM).start()
    before = client.submit_many(batch(8, "lost"))
    wait_for(lambda: worker.faults.slow_packs, what="a slow pack")
    redis_server.stop(kill=True)
    redis_server.wipe()  # everything gone: streams, the group, its pending entries, results
    redis_server.start()
    time.sleep(3.0)  # the worker still holds in-flight entries of the lost group
    # No busy loop against the empty Redis while the group is missing (a crash loop in all but name).
    stats = client.redis.info("commandstats")
    failed = sum(v.get("failed_calls", 0) for v in stats.values())
    assert failed < 100, {k: v for k, v in stats.items() if v.get("failed_calls")}
    after = client.submit_many(batch(6, "after"))
    report = wait_and_check(client.redis, client.keys, before + after, timeout=90, allow_missing=before).assert_ok(
        allow_missing=before)
    assert all(r.ok for r in report.results.values())
    assert set(after) <= set(report.results)
    assert worker.metric("dq_groups_recreated_total") >= 1
    assert "consumer group missing" in caplog.text  # the ERROR line RELIABILITY.md promises
    assert worker.alive and worker.get("/readyz")[0] == 200


def test_redis_paused_longer_than_the_socket_timeout(redis_server, inprocess):
    worker = inprocess(redis_server.url, claim_idle_ms=2000, http=True).start()
    client = Client(redis_server.url)
    ids = client.submit_many(batch(40, "pause"))
    wait_for(lambda: client.fetch(ids[0]), what="a first result")
    redis_server.pause()  # SIGSTOP: connections stay open, nothing answers (the client's socket timeout is 5 s)
    time.sleep(7.0)
    redis_server.resume()
    more = client.submit_many(batch(10, "resumed"))
    report = wait_and_check(client.redis, client.keys, ids + more, timeout=120).assert_ok()
    assert all(r.ok for r in report.results.values())
    assert worker.alive and worker.get("/readyz")[0] == 200


def test_function_flush_mid_run(redis_server, start_worker, tiny_dir):
    worker = start_worker(tiny_dir, redis_server.url, **FANOUT)
    client = Client(redis_server.url)
    flusher = redis.Redis.from_url(redis_server.url)
    flushes = 0
    done = threading.Event()

    def flush():  # a server restarted empty has no functions either; clients that may load them must
        nonlocal flushes
        while not done.is_set():
            flusher.function_flush()
            flushes += 1
            time.sleep(0.02)

    loaded = f"{library.LIBRARY} revision {library.REVISION} loaded"

    def refused() -> int:  # function calls the flushes hit
        return client.redis.info("errorstats").get("errorstat_ERR", {}).get("count", 0)

    thread = threading.Thread(target=flush)
    thread.start()
    try:
        ids = []
        for k in range(24):  # many submit calls: each may meet a flush between a reload and its call
            ids += client.submit_many(batch(3, f"flush{k}") + ([long_request(f"flush-long-{k // 4}")] if k % 4 == 0
                                                                else []))
            time.sleep(0.05)
        # The worker working through flushes too: until it met one and loaded the library again, however long a
        # loaded machine takes to its first publication (a fixed 2 s can end the storm before it), but not all
        # of settle (a 50 Hz storm could starve a fan-out's two rounds of calls for as long as it lasts).
        wait_for(lambda: worker.log.read_text().count(loaded) > 1 and refused() > 0, timeout=120,
                 what="the worker loading the library again, and a function call refused by a flush")
    finally:
        done.set()
        thread.join()
    report = wait_and_check(client.redis, client.keys, ids, timeout=120).assert_ok()
    assert all(r.ok for r in report.results.values()) and flushes > 20
    assert refused() > 0  # the flushes did hit function calls
    log = worker.log.read_text()
    assert log.count(loaded) > 1  # the worker loaded it again
    # Routine after a restart: no error, no 1 s back-off (the messages of the two back-off paths: a refused
    # publication, a batch that failed to settle; the old "failed; retrying" no longer exists, and matched nothing).
    assert "redis refused publish" not in log and "failed; trying again" not in log, log[-3000:]
    assert all(report.results[f"flush-long-{k}"].usage.parts > 1 for k in range(6))


# ---------------------------------------------------------------- entries trimmed or delivered twice


def test_pending_entries_trimmed_from_the_stream(redis_server, inprocess, caplog):
    client = Client(redis_server.url)
    keys = client.keys
    for stream in (keys.requests, keys.parts):
        client.redis.xgroup_create(stream, keys.group, id="0", mkstream=True)
    # Taken by consumers that then died; their payloads trimmed away while pending (MAXLEN / XDEL do that).
    gone = client.submit_many(batch(5, "gone"))
    client.redis.xreadgroup(keys.group, "dead-consumer", {keys.requests: ">"}, count=3)
    client.redis.xreadgroup(keys.group, "w-trim", {keys.requests: ">"}, count=2)  # the worker's own name
    client.redis.xtrim(keys.requests, maxlen=0, approximate=False)
    worker = inprocess(redis_server.url, consumer="w-trim", slow_s=2.0, **FAST_RECLAIM).start()
    # And an entry trimmed while the worker computes it: its payload is in memory, it is answered.
    held = client.submit_many(batch(3, "held"))
    wait_for(lambda: worker.faults.slow_packs, what="a slow pack")
    for entry_id, _ in client.redis.xrange(keys.requests):
        client.redis.xdel(keys.requests, entry_id)
    report = wait_and_check(client.redis, keys, gone + held, timeout=60, allow_missing=gone)
    report.assert_ok(allow_missing=gone)
    assert sorted(report.missing) == sorted(gone)  # nothing to answer them with ...
    assert all(report.results[r].ok for r in held)
    time.sleep(1.0)  # a few more reclaim rounds: the loss must be counted once per entry, whichever path saw it
    lost = worker.metric("dq_lost_entries_total")
    assert lost == 5, caplog.text[-6000:]  # ... but reported
    assert "no payload any more" in caplog.text  # the ERROR line RELIABILITY.md promises


async def bare_loop(url: str, name: str, route) -> tuple[LoopThread, str]:
    """The loop thread's parts alone, on a real server (no planner, no model, no coroutine running; each entry taken
    goes to ``route``): for races a worker process cannot be made to hit on purpose; and the normal lane's request
    stream, its group created."""
    settings = Settings.from_env({}, redis_url=url, claim_idle_ms=60_000, consumer=name)
    loop = LoopThread(settings, Metrics(), planner=None, packer=None, served=("tiny",),
                      event_loop=asyncio.get_running_loop())
    await loop.consumer.ensure_groups()
    loop.lifecycle._route = route
    return loop, Client(url).keys.requests_in(NORMAL)


def test_a_held_entry_trimmed_between_keep_alive_and_reclaim_is_not_counted_lost(redis_server):
    """XAUTOCLAIM reports a deleted pending entry whatever its idle time (Redis 7, Valkey); one held in memory is
    answered from there and is not lost. The race (the trim lands between keep_alive and reclaim) made on purpose:
    keep_alive does nothing here. A trimmed entry nobody holds is still counted."""
    async def scenario() -> float:
        loop, stream = await bare_loop(redis_server.url, "w-held", route=lambda delivery: None)
        consumer, client, intake = loop.consumer, loop.consumer.redis, loop.intake
        held_id, orphan_id = [(await client.xadd(stream, {"body": json.dumps({"id": name})})).decode()
                              for name in ("held", "orphan")]
        deliveries = await consumer.read(NORMAL, 10, 100)  # one at first (``Consumer.careful``), then the other
        for delivery in deliveries + await consumer.read(NORMAL, 10, 100):
            if delivery.request_id == "held":
                loop.lifecycle.take(delivery, "read")  # the orphan stays pending, held by no one
        assert set(loop.held) == {(stream, held_id)}
        await client.xdel(stream, held_id, orphan_id)

        async def no_keep_alive(deliveries) -> None:
            return None

        consumer.keep_alive = no_keep_alive
        intake.recovered.set()  # no readers here: nothing of its own to take back first
        maintenance = asyncio.ensure_future(intake.run_maintenance())
        await asyncio.sleep(0.5)
        maintenance.cancel()
        await client.aclose()
        await consumer.close()
        return intake.metrics.registry.get_sample_value("dq_lost_entries_total")

    assert asyncio.run(scenario()) == 1  # the orphan; not the held one


def test_an_entry_trimmed_before_its_retry_is_retried_from_memory(redis_server):
    """A failed entry is claimed again for its retry (its delivery counter goes up); trimmed meanwhile, the claim
    finds nothing (Redis 7 and Valkey drop it from the pending list): it was let go without a result, a count or a
    log line. Its payload is in memory: it is retried from there, its counter kept by the worker."""
    accepted = []

    async def scenario() -> tuple[str, set]:
        loop, stream = await bare_loop(redis_server.url, "w-retry", route=accepted.append)
        consumer, client, lifecycle = loop.consumer, loop.consumer.redis, loop.lifecycle
        entry_id = (await client.xadd(stream, {"body": json.dumps({"id": "retried"})})).decode()
        [delivery] = await consumer.read(NORMAL, 10, 100)
        lifecycle.take(delivery, "read")
        await client.xdel(stream, entry_id)  # trimmed while its first attempt failed
        await lifecycle._retry(delivery, None)  # no planned task: planned again
        await client.aclose()
        await consumer.close()
        return (stream, entry_id), set(lifecycle.held)

    entry, held = asyncio.run(scenario())
    assert [(d.request_id, d.deliveries) for d in accepted] == [("retried", 1), ("retried", 2)]
    assert held == {entry} and accepted[1].body == accepted[0].body


def test_the_same_part_delivered_twice_is_published_once(redis_server, inprocess):
    """Duplicate entries in the parts stream (a fan-out retried after a lost reply) and duplicate requests."""
    client = Client(redis_server.url)
    keys = client.keys
    request = long_request("twice", questions=6)
    body = json.dumps(request)
    client.redis.set(keys.body("twice"), body)
    groups = [["q0", "q1"], ["q2", "q3"], ["q4", "q5"]]
    for index in (2, 0, 2, 1, 0, 1, 2):  # every part at least twice, out of order
        client.redis.xadd(keys.parts, {"request_id": "twice", "part": index, "parts": len(groups),
                                        "questions": json.dumps(groups[index]), "enqueued_ms": 0})
    ids = ["twice"] + client.submit_many([request | {"id": "dup"}] * 3)  # the same request three times
    inprocess(redis_server.url).burst()
    report = wait_and_check(client.redis, keys, ids, timeout=60).assert_ok()
    result = report.results["twice"]
    assert result.ok and list(result.answers) == list(request["questions"]) and result.usage.parts == 3
    assert report.results["dup"].ok


def test_a_stalled_worker_whose_entries_were_reclaimed_publishes_nothing_twice(redis_server, start_worker, tiny_dir):
    """The same prompt computed twice: a worker frozen mid-pack (SIGSTOP) past the claim idle time loses its
    entries to another worker; thawed, it finishes the pack, and its results are refused as already published."""
    client = Client(redis_server.url)
    frozen = start_worker(tiny_dir, redis_server.url, read_count=4, **slow(1.0), **FAST_RECLAIM)
    ids = client.submit_many(batch(4, "stall"))
    wait_log(frozen, "fault: slow pack")
    frozen.signal(signal.SIGSTOP)
    try:
        other = start_worker(tiny_dir, redis_server.url, **FAST_RECLAIM)
        wait_for(lambda: all(client.fetch(r) for r in ids), timeout=60, what="the other worker's results")
    finally:
        frozen.signal(signal.SIGCONT)
    wait_for(lambda: frozen.metric("dq_packs_total") >= 1, timeout=30, what="the thawed pack")
    report = wait_and_check(client.redis, client.keys, ids, timeout=60).assert_ok()
    assert all(r.ok for r in report.results.values())
    assert other.metric("dq_entries_read_total", how="reclaimed") == 4
    wait_released(frozen)
    assert frozen.metric("dq_results_total") == 0  # computed, but every publication refused
    assert len(report.results) == 4


def test_redis_out_of_memory_while_publishing_loses_nothing(redis_server, start_worker, tiny_dir):
    """Redis full (noeviction): publication fails until memory is freed; counted, logged once, then all land."""
    client = Client(redis_server.url)
    ids = client.submit_many(batch(8, "oom"))
    worker = start_worker(tiny_dir, redis_server.url, **slow(2.0))  # packs slow enough to fill Redis meanwhile
    wait_log(worker, "fault: slow pack")
    # Far below what it uses, so that no write that needs memory gets through while usage wobbles (acks and deletes
    # free some): every such write is now refused with OOM; reads, acks and claims still work.
    client.redis.config_set("maxmemory", 1)
    wait_for(lambda: worker.metric("dq_redis_errors_total", op="publish") >= 3, timeout=60, what="OOM on publish")
    assert all(client.fetch(r) is None for r in ids)  # nothing published, nothing acknowledged and lost
    client.redis.config_set("maxmemory", 0)
    wait_and_check(client.redis, client.keys, ids, timeout=90).assert_ok()
    assert worker.log.read_text().count("redis refused publish") == 1  # one line per 30 s, not one per retry
