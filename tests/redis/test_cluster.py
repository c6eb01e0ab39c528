"""Redis Cluster: every function's keys share a slot, and the whole path runs on a real 3-node cluster."""

import asyncio
import json
import subprocess
import sys

import pytest
import redis
from redis.crc import key_slot

from faults import wait_for
from producer.client import AsyncClient, Client
from producer.local.server import LocalCluster
from producer.plumbing import library_loader
from producer.wire.keys import Keys, shard_of
from test_e2e import QUESTIONS, requests

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def slot(key: str) -> int:
    return key_slot(key.encode())


def test_every_function_and_multi_stream_read_touches_one_slot():
    for shard in range(8):
        keys = Keys("dq", shard)
        # XREADGROUP reads prompts and requests in one call; dead letters sit beside them.
        assert slot(keys.requests) == slot(keys.parts) == slot(keys.dead)
    for request_id in ("a", "ticket-42", "0-1", "x" * 128, "1796223527479-0"):
        keys = Keys()
        # PUBLISH: result, parts, body; PART: parts, result.
        assert slot(keys.result(request_id)) == slot(keys.shares(request_id)) == slot(keys.body(request_id))
    # Shards spread: 8 shard tags do not all land in one third of the slot space.
    assert len({slot(Keys("dq", s).requests) * 3 // 16384 for s in range(8)}) > 1


@pytest.fixture
def cluster():
    with LocalCluster(3) as started:
        yield started


def test_end_to_end_on_a_three_node_cluster_with_two_shards(cluster, start_worker, tiny_dir):
    shards = (0, 1)
    # Streams stay on their shard's node while results spread by request id: functions run on every node.
    settings = dict(redis_cluster=True, max_prompt_tokens=220, fanout_tokens=200)
    workers = [start_worker(tiny_dir, cluster.url, ready=False, shard=s, **settings) for s in shards]  # at once
    for worker in workers:
        worker.wait_ready()

    client = Client(cluster.url, cluster=True, shards=len(shards))
    batch = requests(40, "c")
    many = {f"q{i}": {"type": "choice", "instructions": f"Question {i}?", "criteria": {"yes": "so", "no": "not"}}
            for i in range(24)}
    batch += [{"id": f"long-{k}", "state": f"Long request {k}.", "questions": many} for k in range(4)]
    # Reply streams live in their own slots: the reply follows the publication (at least once); one that is a
    # string is refused, counted, left untouched, and its request answered all the same.
    reply, blocked = Keys().reply_prefix + "svc", Keys().reply_prefix + "is-a-string"
    client.redis.set(blocked, "not a stream")
    for request in batch[:3] + batch[-1:]:
        request["reply_to"] = reply
    batch[3]["reply_to"] = blocked
    ids = client.submit_many(batch)
    # Bad input by plain XADD (the Python producer refuses it before sending).
    bad = json.dumps({"id": "bad", "state": "x", "questions": {"q": {"type": "maybe"}}})
    client.redis.xadd(Keys("dq", shard_of("bad", len(shards))).requests, {"body": bad})
    ids.append("bad")
    results = client.wait_many(ids, timeout=120)

    assert results["bad"].error.code.value == "invalid_request"
    for request in batch:
        result = results[request["id"]]
        assert result.ok, result.error
        assert list(result.answers) == list(request["questions"])
    assert all(results[f"long-{k}"].usage.parts > 1 for k in range(4))  # fanned out and merged by Lua per slot
    wanted = {request["id"] for request in batch[:3] + batch[-1:]}  # replies follow results here: wait for them
    wait_for(lambda: {f[b"id"].decode() for _, f in client.redis.xrange(reply)} == wanted, what="the replies")
    wait_for(lambda: sum(w.metric("dq_redis_errors_total", op="reply") for w in workers) == 1, what="the refusal")
    # Each shard's worker took its shard's requests and parts; both did work.
    for shard, worker in zip(shards, workers):
        mine = [r for r in ids if shard_of(r, len(shards)) == shard]
        assert worker.metric("dq_entries_read_total", stream="requests") == len(mine)
        assert worker.metric("dq_entries_read_total", stream="chunks") > 0
        assert worker.metric("dq_redis_errors_total") == worker.metric("dq_redis_errors_total", op="reply")
    assert client.redis.get(blocked) == b"not a stream" and client.redis.ttl(blocked) == -1
    # Exactly one result each, stored on the node that serves its slot: results spread over all three nodes.
    holders = set()
    for request_id in ids:
        key = Keys().result(request_id)
        node = cluster.node_of(key)
        with redis.Redis(port=node.port) as direct:
            assert direct.xlen(key) == 1
        holders.add(node.port)
    assert len(holders) == 3
    for shard in shards:
        keys = Keys("dq", shard)
        assert client.redis.xlen(keys.requests) == 0 and client.redis.xlen(keys.parts) == 0

    async def through_async_client() -> dict:
        async with AsyncClient(cluster.url, cluster=True, shards=2) as aclient:
            more = await aclient.submit_many([{"id": f"a-{i}", "state": "async", "questions": QUESTIONS}
                                              for i in range(10)])
            return await aclient.wait_many(more, timeout=60)

    assert all(r.ok for r in asyncio.run(through_async_client()).values())
    stats = subprocess.run([sys.executable, "-m", "producer", "stats", "--json", "--cluster", "--redis", cluster.url],
                           capture_output=True, text=True, timeout=60)
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["requests"] == {"length": 0, "pending": 0, "lag": 0, "consumers": 1}


def test_cluster_under_the_acl_users(tmp_path, start_worker, tiny_dir):
    """The ACL roles include what cluster clients need (topology, command table): no denial on any node."""
    from ops.redis_acl import ROLES, render

    passwords = {role: f"test-{role}" for role in ROLES}
    acl = tmp_path / "users.acl"
    acl.write_text(render(passwords))
    with LocalCluster(3, "--aclfile", str(acl), username="admin", password=passwords["admin"]) as cluster:
        port = cluster.nodes[0].port
        url = {role: f"redis://{role}:{passwords[role]}@127.0.0.1:{port}/0" for role in ROLES}
        with redis.RedisCluster.from_url(url["admin"]) as admin:  # dq-worker load-functions --redis-cluster
            assert library_loader.ensure(admin).action == "loaded"
            assert library_loader.ensure(admin).action == "present"
        start_worker(tiny_dir, url["worker"], redis_cluster=True, max_prompt_tokens=220, fanout_tokens=200)
        client = Client(url["producer"], cluster=True)
        many = {f"q{i}": {"type": "noul", "instructions": f"Is statement {i} true?"} for i in range(20)}
        ids = client.submit_many([*requests(10, "acl"), {"id": "long", "state": "Some state.", "questions": many}])
        results = client.wait_many(ids, timeout=120)
        assert all(r.ok for r in results.values()) and results["long"].usage.parts > 1
        monitor = Client(url["monitor"], cluster=True)
        assert monitor.stats()["requests"]["length"] == 0
        for node in cluster.nodes:
            with redis.Redis(port=node.port, username="admin", password=passwords["admin"]) as admin:
                assert admin.acl_log() == [], (node.port, admin.acl_log())


def test_durable_mode_on_a_cluster_confirms_per_primary_and_names_the_ids_one_could_not(tmp_path, start_worker,
                                                                                          tiny_dir):
    """--wait-replicas 1 on a cluster with a replica per primary, under the ACL users: load-functions proves the
    replicas have the library; a worker and both client faces confirm each write and read on its own primary
    (producer/plumbing/cluster_wait.py). With the replica of the primary of the request stream down, a submit and a
    cancel name their batch, a read names exactly the ids on that primary and returns the others (NotDurable); load-functions says
    which primary fell short; once the replica is back, everything goes through. No ACL denial on any node (the
    producer's read marks are keys of its own)."""
    from ops.redis_acl import ROLES, render

    from producer.client import NotDurable

    passwords = {role: f"test-{role}" for role in ROLES}
    acl = tmp_path / "users.acl"
    acl.write_text(render(passwords))
    replication = ("--masteruser", "admin", "--masterauth", passwords["admin"])
    with LocalCluster(3, "--aclfile", str(acl), *replication, username="admin", password=passwords["admin"],
                      replicas=1) as cluster:
        port = cluster.nodes[0].port
        url = {role: f"redis://{role}:{passwords[role]}@127.0.0.1:{port}/0" for role in ROLES}

        def load_functions() -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "worker", "load-functions", "--redis", url["admin"],
                                   "--cluster", "--wait-replicas", "1"], capture_output=True, text=True, timeout=60)

        loaded = load_functions()
        assert loaded.returncode == 0 and "1 replicas of every primary have both" in loaded.stdout, loaded.stderr
        start_worker(tiny_dir, url["worker"], redis_cluster=True, wait_replicas=1)
        client = Client(url["producer"], cluster=True, wait_replicas=1)
        ids = client.submit_many(requests(30, "durable"))
        assert all(r.ok for r in client.wait_many(ids, timeout=120).values())
        primary = cluster.node_of(Keys().requests)
        replica = cluster.replicas[cluster.nodes.index(primary)]
        there = [i for i in ids if cluster.node_of(Keys().result(i)) is primary]
        assert 0 < len(there) < len(ids)  # results spread over the three primaries
        replica.stop(kill=True)
        with pytest.raises(NotDurable) as unconfirmed:
            client.submit_many(requests(3, "later"))
        assert unconfirmed.value.ids == ["later-0", "later-1", "later-2"] and unconfirmed.value.replicas == 0
        # A cancel too, confirmed on its records' primary (before, its WAIT went through the cluster client, which
        # summed every primary's answer, and the cancel was taken as confirmed).
        with pytest.raises(NotDurable) as uncancelled:
            client.cancel("never-sent")
        assert uncancelled.value.ids == ["never-sent"] and uncancelled.value.replicas == 0
        with pytest.raises(NotDurable) as caught:  # after its first look (a WAIT of 2 s): a longer wait looks again
            client.wait_many(ids, timeout=1)
        assert sorted(caught.value.ids) == sorted(there) and (caught.value.replicas, caught.value.wanted) == (0, 1)
        others = [i for i in ids if i not in there]
        assert set(client.wait_many(others, timeout=10)) == set(others)

        async def asynchronously() -> tuple[list[str], set[str]]:
            async with AsyncClient(url["producer"], cluster=True, wait_replicas=1) as face:
                with pytest.raises(NotDurable) as refused:
                    await face.wait_many(ids, timeout=1)
                return refused.value.ids, set(await face.wait_many(others, timeout=10))

        named, returned = asyncio.run(asynchronously())
        assert sorted(named) == sorted(there) and returned == set(others)
        # Once the cluster no longer lists the dead replica (its first contact asks every node): short, and where.
        short = wait_for(lambda: (done := load_functions()).returncode == 1 and "fewer than 1" in done.stderr and done,
                         timeout=30, what="load-functions to find a primary without its replica")
        assert f"127.0.0.1:{primary.port} (0)" in short.stderr and "revision" in short.stdout, short.stderr
        replica.start()
        assert set(client.wait_many(ids, timeout=30)) == set(ids)
        assert client.submit_many(requests(3, "later")) == ["later-0", "later-1", "later-2"]  # again, by id
        assert all(r.ok for r in client.wait_many(["later-0", "later-1", "later-2"], timeout=60).values())
        for node in cluster.nodes + cluster.replicas:
            with redis.Redis(port=node.port, username="admin", password=passwords["admin"]) as admin:
                assert admin.acl_log() == [], (node.port, admin.acl_log())


def test_a_fan_out_stores_the_request_before_any_part_can_be_read(cluster):
    """A fanned-out request's body and its parts live in different slots, on different primaries. Its parts must
    not be readable before its body is stored: a part read first found no body and answered the whole request with
    an error result that carries no digest, which its producer then read as ``id_conflict`` (seen on a loaded
    machine). The body's primary holds its writes for a moment (CLIENT PAUSE WRITE): no part may appear meanwhile."""
    from types import SimpleNamespace

    from producer.client import aconnect
    from worker.loop.publisher import Publisher

    keys = Keys("dq", 0)
    stream = keys.parts_in("normal")
    request_id = next(f"fan-{n}" for n in range(1000)
                      if owner(cluster, keys.body(f"fan-{n}")) != owner(cluster, stream))
    entry = SimpleNamespace(body=b'{"id": "%s"}' % request_id.encode(), lane="normal", enqueued_ms=0)
    task = SimpleNamespace(delivery=entry, fan_out=[["a"], ["b"]], request_id=request_id,
                           request=SimpleNamespace(traceparent=None))
    parts = redis.Redis(port=owner(cluster, stream))
    seen = []

    async def run():
        client = aconnect(cluster.url, cluster=True)
        publisher = Publisher(client, keys, 600, "tiny")
        publisher.ack = acknowledged  # the request entry is made up: nothing to acknowledge
        redis.Redis(port=owner(cluster, keys.body(request_id))).execute_command("CLIENT", "PAUSE", 1500, "WRITE")
        fanning = asyncio.ensure_future(publisher.fan_out(task))
        for _ in range(20):  # while the body's primary holds its writes
            await asyncio.sleep(0.05)
            seen.append(parts.xlen(stream))
        await fanning
        await client.aclose()

    asyncio.run(run())
    assert seen and max(seen) == 0, f"parts readable before their request's body was stored: {seen}"
    assert redis.RedisCluster.from_url(cluster.url).get(keys.body(request_id)) is not None
    assert parts.xlen(stream) == 2


async def acknowledged(*args, **kwargs):
    return []


def owner(cluster, key: str) -> int:
    """The port of the primary that serves ``key``'s slot."""
    for first, last, primary, *_ in redis.Redis(port=cluster.nodes[0].port).execute_command("CLUSTER", "SLOTS"):
        if first <= slot(key) <= last:
            return int(primary[1])
    raise AssertionError(f"no primary serves {key}")
