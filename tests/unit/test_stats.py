"""Stats count a worker from its heartbeat, not from XINFO CONSUMERS' idle time: Redis 7.0 refreshes a consumer's
idle time only when a read returns entries, so a live, ready worker blocked in XREADGROUP on a quiet stream showed
CONSUMERS 0 after 30 s. The stats plan (producer/client/stats.py) is run on the replies Redis 7.0 gives in that
state: waiting 30 s on a real server for a consumer to look idle is what this spares the suite (the heartbeat's
and the pending count's side run on real servers: tests/redis/test_presence.py)."""

import json
import time

from producer.client.plans import Producer
from producer.client.stats import stats
from producer.wire.keys import GROUP, Keys


def run(plan, reply):
    """Drive a plan to its end, each command answered by ``reply(name, words)``."""
    try:
        step = next(plan)
        while True:
            step = plan.send(reply(step.words[0], step.words[1:]))
    except StopIteration as done:
        return done.value


def redis_7_0(consumers: list[dict], beats: dict[bytes, bytes]):
    def reply(name: str, args: tuple):
        return {"XLEN": 0, "HGETALL": beats if args[0].endswith(":workers") else {},
                "XINFO GROUPS": [{"name": GROUP.encode(), "pending": 0, "lag": 0}],
                "XINFO CONSUMERS": consumers}[name]
    return reply


def test_a_worker_blocked_on_a_quiet_stream_counts_from_its_heartbeat():
    beat = json.dumps({"ts": time.time() - 2, "inflight": 0, "state": "ready", "shard": 0}).encode()
    idle = [{"name": b"host-1", "pending": 0, "idle": 45_000}]  # its last read that returned entries: 45 s ago
    figures = run(stats(Producer(Keys("dq"), 1, 0, False)), redis_7_0(idle, {b"host-1": beat}))
    assert figures["workers"] == 1
    assert figures["requests"]["consumers"] == 1 and figures["chunks"]["consumers"] == 1


def test_a_consumer_without_a_live_worker_counts_only_while_it_holds_entries():
    stale = json.dumps({"ts": time.time() - 600, "inflight": 3}).encode()
    consumers = [{"name": b"gone", "pending": 0, "idle": 5_000}, {"name": b"holding", "pending": 2, "idle": 90_000},
                 {"name": b"stale", "pending": 0, "idle": 1_000}]
    figures = run(stats(Producer(Keys("dq"), 1, 0, False)), redis_7_0(consumers, {b"stale": stale}))
    assert figures["workers"] == 0 and figures["requests"]["consumers"] == 1  # the one holding entries
