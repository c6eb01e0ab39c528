"""``dq-producer stats`` as tables: a snapshot of one reading (two shards, a stream with no group yet, a worker
gone, a worker of an older release whose beat lacks fields), and ``--watch``'s frames."""

import io

import redis

from producer.cli import table


def lane(length, pending=None, lag=None, consumers=None, parts=0):
    requests = {"length": length}
    if pending is not None:
        requests.update(pending=pending, lag=lag, consumers=consumers)
    return {"requests": requests, "chunks": {"length": parts}}


STATS = {
    "workers": 2, "dead_letters": 3,
    "lanes": {"high": lane(1, 1, 0, 1), "normal": lane(45, 12, 33, 2, parts=4)},
    "shards": [
        {"shard": 0, "dead_letters": 3, "lanes": {"high": lane(1, 1, 0, 1), "normal": lane(40, 12, 28, 2, parts=4)}},
        {"shard": 1, "dead_letters": 0, "lanes": {"high": lane(0), "normal": lane(5)}},  # no group yet
    ],
    "heartbeats": [
        {"name": "gpu-node-a-4121", "shard": 0, "model": "jev-decider-2b", "engine": "fast", "state": "ready",
         "held": 64, "beat_age_s": 1.4},
        {"name": "gpu-node-b-977", "shard": 0, "model": "jev-decider-2b", "engine": "fast", "state": "draining",
         "held": 3, "beat_age_s": 4.0},
        {"name": "old-worker", "shard": None, "model": "jev-decider-2b", "engine": "fast", "state": "gone",
         "held": 0, "beat_age_s": 95.2},
    ],
}

SNAPSHOT = """\
namespace shop: 2 shards, 2 workers live, 3 dead letters (shard 0: 3, shard 1: 0)

SHARD  LANE    REQUESTS  PENDING  LAG  PARTS  PARTS PENDING  PARTS LAG  CONSUMERS
0      high           1        1    0      0              -          -          1
0      normal        40       12   28      4              -          -          2
1      high           0        -    -      0              -          -          -
1      normal         5        -    -      0              -          -          -
all    high           1        1    0      0              -          -          1
all    normal        45       12   33      4              -          -          2

WORKER           SHARD  MODEL           ENGINE  STATE     HELD   LAST BEAT
gpu-node-a-4121  0      jev-decider-2b  fast    ready       64   1.4 s ago
gpu-node-b-977   0      jev-decider-2b  fast    draining     3   4.0 s ago
old-worker       -      jev-decider-2b  fast    gone         0  95.2 s ago
gone: no heartbeat for 30 s or more (a live worker deletes such beats)
"""


def test_the_table_of_one_reading():
    assert table.render(STATS, "shop") == SNAPSHOT


def test_no_worker_is_said_in_words():
    empty = {**STATS, "workers": 0, "heartbeats": []}
    assert table.render(empty, "typo").splitlines()[-1] == (
        "no worker has a heartbeat in namespace 'typo': nothing will answer until one starts (is the namespace right?)")


def test_watch_draws_frame_after_frame_and_says_a_failed_read():
    def refused():
        raise redis.ConnectionError("Connection refused")

    readings = iter([lambda: table.render(STATS, "shop"), refused, lambda: table.render(STATS, "shop")])
    out = io.StringIO()
    table.watch(lambda: next(readings)(), 0.1, out, frames=3)
    frames = out.getvalue().split("\nevery ")
    assert len(frames) == 3 and all(frame.startswith(("every 0.1 s, ", "0.1 s, ")) for frame in frames)
    assert frames[0].endswith(SNAPSHOT) and frames[2].endswith(SNAPSHOT)
    assert frames[1].endswith("(Ctrl-C stops)\n\ncannot read the queue: ConnectionError: Connection refused\n")
