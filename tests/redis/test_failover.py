"""Failover under load (docs/RELIABILITY.md, "Failover"): a primary, a replica and three sentinels on loopback, two
worker processes and producers with ids, all through a ``redis+sentinel://`` URL, in durable mode
(``--wait-replicas 1``); the primary is killed (-9) and restarted as a replica, then frozen past the sentinels'
down-after time and let go (it answers as a primary for 10 s more). About 40 s per server: the planned failover
(``SENTINEL FAILOVER``) is left to ops/failover.py, which runs 20 of each kind with N = 0 and N = 1 and writes the
table the docs quote. The same on Redis Cluster (ops/failover_cluster.py), and sentinels that require a password."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import redis

from ops.failover import session
from ops.failover_cluster import Clustered
from ops.failover_deployments import KINDS, Replicated
from producer.client import AsyncClient, Client, NotDurable, RedisUnreachable
from producer.local.server import RedisServer
from producer.wire.keys import Field, Keys
from producer.wire.library import REVISION
from producer.wire.result import Result

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def test_durable_mode_loses_nothing_acknowledged_through_a_kill_and_a_freeze(tiny_dir, tmp_path):
    assert KINDS[:2] == ("kill", "stop")  # "mixed" takes the kinds in this order
    [run] = session(tiny_dir, [("mixed", 1, 2)], logs=tmp_path, gap_s=0.5, drain_s=30.0)
    row = run.row()
    print("\nfailover:", json.dumps(row))
    assert len(run.failovers) == 2 and row["acked"] > 0 and row["read"] > 0, row
    # acknowledged and never answered, read and then lost or changed, left pending, workers exited or wedged
    assert (run.lost, run.read_lost, run.changed, run.pending, run.workers_down) == (0, 0, 0, 0, 0), row
    assert run.library == REVISION  # the promoted node had the library by replication


def test_durable_mode_on_a_cluster_loses_nothing_through_a_kill_and_a_kill_during_a_resync(tiny_dir, tmp_path):
    """Redis Cluster, three primaries with a replica each, --wait-replicas 1: the primary of shard 0's streams killed
    (-9) with its replica in sync, then, once that replica was killed and restarted, again 1 s into its first sync
    (``unsynced``): the cluster promotes a replica that has only its own old data (validity factor 0), and the
    writes that primary took meanwhile are gone. With --wait-replicas 0 that second kill loses them (hundreds of
    requests acknowledged and results read over 3 such kills: docs/RELIABILITY.md); durable mode acknowledged none
    of them, each write confirmed by a WAIT on its own primary (producer/plumbing/cluster_wait.py)."""
    assert Clustered.KINDS[:2] == ("kill", "unsynced")  # "mixed" takes them in this order
    [run] = session(tiny_dir, [("mixed", 1, 2)], logs=tmp_path, clustered=True, gap_s=0.5, drain_s=30.0)
    row = run.row()
    print("\ncluster failover:", json.dumps(row))
    assert len(run.failovers) == 2 and row["acked"] > 0 and row["read"] > 0, row
    assert (run.lost, run.read_lost, run.changed, run.pending, run.workers_down) == (0, 0, 0, 0, 0), row
    assert run.library == REVISION


def test_a_slot_migration_under_load_takes_no_worker_down_and_fails_no_request(tiny_dir, tmp_path):
    """Redis Cluster in durable mode, two workers under load: shard 0's slot (its work streams, cancels and records)
    moved to another primary in batches and back, as ``redis-cli --cluster reshard`` does. Meanwhile calls are
    answered ASK (a key moved), TRYAGAIN (a call over several keys of the slot, some moved), or the redirected call
    runs out of redirects (``ClusterError: TTL exhausted``) and a blocked read ends (``UNBLOCKED``): Redis trouble,
    waited out, never a worker's exit nor a delivery of a poison request (which once dead-lettered a valid one)."""
    [run] = session(tiny_dir, [("migrate", 1, 2)], logs=tmp_path, clustered=True, gap_s=1.0, drain_s=30.0)
    row = run.row()
    print("\nslot migration:", json.dumps(row))
    assert len(run.failovers) == 2 and row["acked"] > 0 and row["read"] > 0, row
    # acknowledged and never answered, read and then lost or changed, left pending, workers exited or wedged, valid
    # requests answered with an error (dead_lettered)
    assert (run.lost, run.read_lost, run.changed, run.pending, run.workers_down, run.answered_error) == (
        0, 0, 0, 0, 0, {}), row
    logs = "".join(log.read_text() for log in tmp_path.glob("worker-*.log"))
    assert "cannot serve the slot for now" in logs  # the workers met the moving slot, and waited
    for never in ("CRITICAL", "dead-lettering", "consumer group missing", "redis refused"):
        assert never not in logs, never


def test_sentinels_that_require_a_password(start_worker, tiny_dir, monkeypatch):
    """Sentinels with ``requirepass``: a worker and a producer given DQ_SENTINEL_PASSWORD find the primary and
    follow a failover; without it, or with a wrong one, the error says the sentinels refused authentication, and
    never shows the password."""
    cluster = Replicated(sentinel_password="sentinel-s3cret").launch()
    try:
        monkeypatch.setenv("DQ_SENTINEL_PASSWORD", "sentinel-s3cret")  # the worker process inherits it
        worker = start_worker(tiny_dir, cluster.url, ready=False)  # it loads its model while the sentinels settle
        cluster.settle()
        worker.wait_ready()
        client = Client(cluster.url)
        assert client.decide({"id": "before", "state": "s", "questions": {"q": {"type": "noul"}}}).ok
        cluster.fail("kill")
        assert client.decide({"id": "after", "state": "s", "questions": {"q": {"type": "noul"}}}, timeout=60).ok
        for password in ("wrong-s3cret", None):
            if password:
                monkeypatch.setenv("DQ_SENTINEL_PASSWORD", password)
            else:
                monkeypatch.delenv("DQ_SENTINEL_PASSWORD")
            with pytest.raises(RedisUnreachable, match="the sentinels refused authentication") as refused:
                Client(cluster.url).fetch("before")
            assert "s3cret" not in str(refused.value)
    finally:
        cluster.close()


def test_without_its_replica_durable_mode_refuses_and_names_the_ids():
    """A replica that does not confirm (frozen): the submit raises NotDurable naming its ids, a result that is on
    the primary alone is not returned; once the replica is back, both go through, the resubmission answered once."""
    with RedisServer("--repl-diskless-sync-delay", "0") as primary, \
            RedisServer("--replicaof", "127.0.0.1", str(primary.port)) as replica:  # no 5 s before the first sync
        client = Client(primary.url, wait_replicas=1)
        while redis.Redis(port=replica.port).info("replication")["master_link_status"] != "up":
            time.sleep(0.05)
        client.submit({"id": "first", "state": "s", "questions": {"q": {"type": "noul"}}})  # the replica confirms

        async def asynchronously() -> None:  # the asyncio face pipelines its WAITs the same way
            async with AsyncClient(primary.url, wait_replicas=1) as face:
                assert await face.submit({"id": "async", "state": "s", "questions": {"q": {"type": "noul"}}})
                assert await face.fetch("first") is None

        asyncio.run(asynchronously())
        replica.pause()
        try:
            with pytest.raises(NotDurable) as caught:
                client.submit_many([{"id": f"r-{n}", "state": "s", "questions": {"q": {"type": "noul"}}}
                                    for n in range(2)])
            assert caught.value.ids == ["r-0", "r-1"] and (caught.value.replicas, caught.value.wanted) == (0, 1)
            body = Result(id="r-0", status="ok", answers={}).model_dump_json()
            redis.Redis(port=primary.port).xadd(Keys("dq").result("r-0"), {Field.BODY: body})
            with pytest.raises(NotDurable) as read:
                client.wait("r-0", timeout=1.0)
            assert read.value.ids == ["r-0"]
            assert Client(primary.url).fetch("r-0") is not None  # there, on the primary alone
        finally:
            replica.resume()
        assert client.submit_many([{"id": "r-1", "state": "s", "questions": {"q": {"type": "noul"}}}]) == ["r-1"]
        assert client.wait("r-0", timeout=10.0).id == "r-0"
