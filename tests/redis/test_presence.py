"""Workers and consumers that are gone are forgotten: a dead consumer with nothing pending is deleted from the group
once idle past --consumer-gone-ms (one holding entries is kept until they are settled), stale heartbeats are
deleted, and stats count the living only."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import redis

from faults import batch, wait_for
from producer.client import Client
from producer.wire.keys import GONE_S

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def consumers(connection: redis.Redis, key: str, group: str) -> dict[str, int]:
    """Consumer name -> its pending entries."""
    return {c["name"].decode(): c["pending"] for c in connection.xinfo_consumers(key, group)}


def stats(url: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "producer", "stats", "--json", "--redis", url], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_gone_are_forgotten_and_stats_count_the_living(redis_server, start_worker, tiny_dir):
    client = Client(redis_server.url)
    keys, r = client.keys, client.redis
    # A worker that ran and was killed: its consumer and its heartbeat stay behind.
    dead = start_worker(tiny_dir, redis_server.url, consumer="dead-worker")
    client.wait_many(client.submit_many(batch(4, "before")), timeout=60)
    wait_for(lambda: r.hexists(keys.workers(), "dead-worker"), what="its heartbeat")
    # Its acknowledgements landed (a result is published before its entry is acked): killed before them, it would
    # rightly keep its consumer for the entries it still holds.
    wait_for(lambda: consumers(r, keys.requests, keys.group).get("dead-worker") == 0, what="its acknowledgements")
    dead.stop()
    # A consumer that died holding an entry (read, never acknowledged), and a heartbeat an hour old.
    client.submit_many(batch(1, "held"))
    [[_, [(held, _)]]] = r.xreadgroup(keys.group, "died-holding", {keys.requests: ">"}, count=1)
    r.hset(keys.workers(), "ghost", json.dumps({"ts": time.time() - 3600, "inflight": 0}))
    before = stats(redis_server.url)
    assert before["workers"] == 1  # the ghost's beat is older than GONE_S: not counted (the killed one's is fresh)
    assert before["requests"]["consumers"] == 2 and set(consumers(r, keys.requests, keys.group)) == {
        "dead-worker", "died-holding"}

    # A live worker that would reclaim only after a minute: the holder keeps its consumer while it holds.
    start_worker(tiny_dir, redis_server.url, consumer="live", consumer_gone_ms=2000, claim_idle_ms=60000)
    wait_for(lambda: "dead-worker" not in consumers(r, keys.requests, keys.group), timeout=60,
             what="dead-worker forgotten")
    # From every stream, but not necessarily in the round that logged: each lane's reader last touched its streams at
    # its own time (up to a BLOCK apart), and the streams are checked one after the other, so the high lane's may
    # cross the idle limit a round before these ones.
    wait_for(lambda: "dead-worker" not in consumers(r, keys.parts, keys.group), timeout=15,
             what="dead-worker forgotten from the part stream too")
    wait_for(lambda: not r.hexists(keys.workers(), "ghost"), what="the ghost's heartbeat deleted")
    time.sleep(6)  # more maintenance rounds, the holder idle past the limit: it stays, and so does its entry
    assert consumers(r, keys.requests, keys.group) == {"died-holding": 1, "live": 0}
    assert r.xpending(keys.requests, keys.group)["pending"] == 1
    now = stats(redis_server.url)
    assert now["requests"]["consumers"] == 2  # the live worker, and the one still holding an entry

    # Once its entry is settled (acknowledged, as a reclaim and an answer would), the holder goes too; the killed
    # worker's heartbeat goes once it is GONE_S old: both in the next maintenance round (one every 5 s).
    r.xack(keys.requests, keys.group, held)
    # Its beat as it will be GONE_S after the kill (rather than waiting those seconds): deleted like the ghost's.
    r.hset(keys.workers(), "dead-worker", json.dumps({"ts": time.time() - GONE_S - 1, "inflight": 0}))
    wait_for(lambda: set(consumers(r, keys.requests, keys.group)) == {"live"}, timeout=30, what="the holder gone")
    wait_for(lambda: not r.hexists(keys.workers(), "dead-worker"), timeout=30, what="the beat deleted")
    after = stats(redis_server.url)
    assert after["workers"] == 1 and after["requests"]["consumers"] == 1
    # A live worker counts on a quiet stream too (no part was ever sent here), from its heartbeat: Redis 7.0, which
    # refreshes a consumer's idle time only when a read returns entries, showed it idle there after 30 s.
    assert after["chunks"]["consumers"] == 1
    assert set(r.hkeys(keys.workers())) == {b"live"}
