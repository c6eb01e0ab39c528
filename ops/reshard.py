"""What a shard's records cost when its slot moves on Redis Cluster: a local cluster of three primaries, shard 0's
slot filled with N answered requests' records (written as the queue writes them: the submit function, then a
worker's answered fields and TTL), moved to another primary as ``redis-cli --cluster reshard`` moves a slot
(``CLUSTER SETSLOT IMPORTING`` and ``MIGRATING``, ``MIGRATE ... KEYS`` in batches of ``--pipeline`` keys, ``SETSLOT
NODE``), timed. The server is the embedded Valkey, or ``DQ_REDIS_SERVER``. docs/PROTOCOL.md ("Records and the
shard's slot") has the figures.

    python ops/reshard.py                                  # 30,000 records; batches of 10 (redis-cli's default), 1000
    DQ_REDIS_SERVER=/usr/bin/redis-server python ops/reshard.py --records 300000 --pipeline 10,100,1000
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402
from redis.crc import key_slot  # noqa: E402

from ops.failover_cluster import move_slot  # noqa: E402
from producer.client import Client  # noqa: E402
from producer.local.server import LocalCluster  # noqa: E402
from producer.wire.keys import Keys, Record, RecordState  # noqa: E402

KEYS = Keys()
QUESTIONS = {"refund": {"type": "noul", "instructions": "Is a refund requested?"}}


def fill(cluster: LocalCluster, records: int) -> int:
    """``records`` answered requests of shard 0: their entries gone (acknowledged and deleted), their records
    kept as a worker leaves them. The bytes one record takes (``MEMORY USAGE``)."""
    with Client(cluster.url, cluster=True, max_unfinished=0) as client:
        for start in range(0, records, 1000):
            client.submit_many([{"id": f"r-{n:08d}", "state": "I was charged twice.", "questions": QUESTIONS}
                                for n in range(start, min(records, start + 1000))])
    node = redis.Redis(port=cluster.node_of(KEYS.requests).port)
    now = int(time.time() * 1000)
    pipe = node.pipeline(transaction=False)
    for n in range(records):
        record = KEYS.record(f"r-{n:08d}")
        pipe.hset(record, mapping={Record.STATE: RecordState.ANSWERED, Record.STATUS: "ok", Record.CODE: "",
                                   Record.AT: now, Record.CONSUMER: "host-a-4211", Record.SINCE: now})
        pipe.expire(record, 86400)
        if n % 1000 == 999:
            pipe.execute()
    pipe.execute()
    node.xtrim(KEYS.requests, maxlen=0)
    size = int(node.memory_usage(KEYS.record("r-00000000")))
    node.close()
    return size


def move(cluster: LocalCluster, pipeline: int) -> tuple[int, float]:
    """Shard 0's slot to the next primary, batch by batch as redis-cli's reshard does: (keys moved, seconds)."""
    owner = cluster.node_of(KEYS.requests)
    target = next(node for node in cluster.nodes if node is not owner)
    started = time.perf_counter()
    moved = move_slot(key_slot(KEYS.requests.encode()), owner, target, cluster.nodes, pipeline)
    return moved, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=30_000)
    parser.add_argument("--pipeline", default="10,1000", help="keys per MIGRATE, comma-separated: one run each")
    args = parser.parse_args(argv)
    print("server | records | keys per MIGRATE | keys moved | seconds | keys/s | bytes per record")
    for pipeline in (int(p) for p in args.pipeline.split(",")):
        with LocalCluster(3) as cluster:
            size = fill(cluster, args.records)
            server = cluster.nodes[0].server
            moved, seconds = move(cluster, pipeline)
        print(f"{server} | {args.records} | {pipeline} | {moved} | {seconds:.2f} | {moved / seconds:,.0f} | {size}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
