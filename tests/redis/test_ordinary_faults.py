"""Ordinary faults never change an answer, in process against each supported server: dropped connections do not
count as deliveries; a deleted stream or a flushed server costs the group once, never the worker; a drain takes
nothing new. Each test names the defect it covers (its number in docs/RELIABILITY.md's list of faults)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from faults import FANOUT, batch, long_request, next_report, wait_for
from producer.admin.audit import wait_and_check
from producer.client import Client
from worker.health import status

pytestmark = pytest.mark.redis


def kill_others(client: Client) -> int:
    """CLIENT KILL every connection but the test's own: the worker's, mid-call."""
    mine = client.redis.client_id()
    killed = 0
    for connection in client.redis.client_list():
        if int(connection["id"]) != mine:
            killed += client.redis.client_kill_filter(_id=connection["id"])
    return killed


def replies_on(client: Client, names) -> dict[str, list[dict]]:
    """The results on each named reply stream (``<namespace>:v1:reply:<name>``), in order."""
    return {name: [json.loads(fields[b"body"]) for _, fields in client.redis.xrange(client.keys.reply_prefix + name)]
            for name in names}


def test_dropped_connections_do_not_count_as_deliveries(redis_server, inprocess):
    """Faults 1 and 6: after a failed call the reader recovers its own pending entries; those it holds are not
    read again, so their delivery counters stay at 1 however many times the connection drops. A held entry whose
    counter grew would be dead-lettered as poison after a later crash."""
    client = Client(redis_server.url)
    ids = client.submit_many(batch(6, "held"))
    worker = inprocess(redis_server.url, slow_s=4.0, max_wait_ms=1, max_deliveries=2).start()
    wait_for(lambda: len(worker.daemon.loop.held) == 6, 20, what="six held entries")
    killed = 0
    for _ in range(4):  # each time the worker has reconnected (its readers retry after 0.5 s)
        killed += kill_others(client)
        time.sleep(0.7)
    assert killed >= 4
    pending = client.redis.xpending_range(client.keys.requests, client.keys.group, "-", "+", 100)
    assert len(pending) == 6 and {entry["times_delivered"] for entry in pending} == {1}
    report = wait_and_check(client.redis, client.keys, ids, timeout=60).assert_ok()
    assert all(report.results[i].ok for i in ids)
    worker.stop()
    assert worker.metric("dq_dead_letters_total") == 0 and worker.metric("dq_redis_errors_total") > 0
    assert worker.exit_code is None


def test_a_deleted_stream_or_flushed_server_recreates_the_group_once_and_the_worker_serves_on(redis_server,
                                                                                             inprocess):
    """Faults 5 and 16: a blocked read answered 'UNBLOCKED the stream key no longer exists' (Redis 7.0) or NOGROUP
    (Valkey) recreates the group; it once ended every worker of the shard with exit 70 on Redis 7.0. Both lanes'
    readers and the maintenance loop notice a FLUSHALL at once: the loss is counted once."""
    client = Client(redis_server.url)
    worker = inprocess(redis_server.url, block_ms=2000).start()
    time.sleep(0.3)  # both lanes' readers are blocked in XREADGROUP now
    client.redis.delete(client.keys.requests)
    wait_for(lambda: worker.metric("dq_groups_recreated_total") == 1, 20, what="the group recreated")
    client.redis.flushall()
    wait_for(lambda: worker.metric("dq_groups_recreated_total") == 2, 20, what="the group recreated again")
    time.sleep(1.0)
    assert worker.metric("dq_groups_recreated_total") == 2 and worker.exit_code is None
    [request_id] = client.submit_many(batch(1, "after"))
    assert wait_and_check(client.redis, client.keys, [request_id], timeout=30).assert_ok().results[request_id].ok
    worker.stop()
    assert worker.exit_code is None



def test_a_group_recreated_on_a_drained_stream_reports_no_deleted_requests(redis_server, inprocess):
    """A group lost under running workers was made again at 0-0, which took every entry the workers had answered
    and deleted for one deleted before it was read: it paged for requests lost (and blamed producers' credentials)
    when none was. It starts just before the stream's first entry now; only the group's loss is reported."""
    client = Client(redis_server.url)
    keys = client.keys
    worker = inprocess(redis_server.url, block_ms=500).start()
    done = client.submit_many(batch(3, "answered"))
    wait_and_check(client.redis, keys, done, timeout=30).assert_ok()
    client.redis.xgroup_destroy(keys.requests, keys.group)
    wait_for(lambda: worker.metric("dq_groups_recreated_total") == 1, 20, what="the group recreated")
    [after] = client.submit_many(batch(1, "after"))
    assert wait_and_check(client.redis, keys, [after], timeout=30).assert_ok().results[after].ok
    next_report(worker)
    assert worker.metric("dq_unread_entries_deleted_total") == 0
    [group] = [g for g in client.redis.xinfo_groups(keys.requests) if g["name"].decode() == keys.group]
    assert group["lag"] == 0  # its lag is known (entries read given at creation): the autoscaler sees it
    worker.stop()


def test_a_drain_takes_no_other_workers_entries(redis_server, inprocess):
    """Fault 13: while draining, the maintenance loop keeps its own entries alive but reclaims nothing."""
    client = Client(redis_server.url)
    keys = client.keys
    worker = inprocess(redis_server.url, slow_s=3.0, max_wait_ms=1, claim_idle_ms=300).start()
    [busy] = client.submit_many(batch(1, "busy"))
    wait_for(lambda: worker.daemon.loop.held, 20, what="a held entry")
    worker.daemon.stop()
    time.sleep(0.3)  # a read in flight when the stop came has ended
    for request in batch(3, "orphan"):  # a dead worker's entries, idle past --claim-idle-ms while this one drains
        client.submit(request)
    client.redis.xreadgroup(keys.group, "dead-worker", {keys.requests: ">"})
    time.sleep(1.2)
    worker.join(30)
    assert worker.metric("dq_entries_read_total", how="reclaimed") == 0
    pending = client.redis.xpending_range(keys.requests, keys.group, "-", "+", 100)
    assert sorted(entry["consumer"] for entry in pending) == [b"dead-worker"] * 3
    assert client.redis.xlen(keys.result(busy)) == 1  # its own entry was drained: answered


def test_entries_deleted_before_any_worker_read_them_are_detected(redis_server, inprocess):
    """Fault 2: a producer credential may XADD, and XADD ... MAXLEN 0 trims the stream: ACLs cannot refuse an
    argument. The loss cannot be undone, but it is seen: the stream's largest deleted id passes the group's last
    delivered one; counted once per trim (dq_unread_entries_deleted_total, alert DecisionQueueRequestsDeleted)."""
    client = Client(redis_server.url)
    keys = client.keys
    client.submit_many(batch(5, "trimmed"))
    client.redis.xadd(keys.requests, {"body": "{}"}, maxlen=0, approximate=False)  # a leaked producer key at work
    assert client.redis.xlen(keys.requests) == 0
    worker = inprocess(redis_server.url).start()
    found = dict(stream="requests", lane="normal")
    wait_for(lambda: worker.metric("dq_unread_entries_deleted_total", **found) == 1, 20, what="the trim detected")
    [kept] = client.submit_many(batch(1, "kept"))  # delivered and deleted by the worker: no new detection
    assert wait_and_check(client.redis, keys, [kept], timeout=30).assert_ok().results[kept].ok
    next_report(worker)
    assert worker.metric("dq_unread_entries_deleted_total") == 1
    worker.stop()


def test_reply_and_dead_letter_streams_keep_to_their_caps(redis_server, inprocess):
    """Fault 4: each reply refreshed its stream's TTL and nothing trimmed it; dead letters were kept for ever. Both
    are capped now (approximate MAXLEN: a node of up to 100 entries at a time)."""
    client = Client(redis_server.url)
    keys = client.keys
    reply_to = keys.reply_prefix + "busy"
    ids = client.submit_many([{**request, "reply_to": reply_to} for request in batch(250, "capped")])
    for n in range(250):  # parts that name no request: dead-lettered unanswered, at once
        client.redis.xadd(keys.parts, {"part": n})
    inprocess(redis_server.url, reply_maxlen=100, dead_maxlen=100).burst()
    report = wait_and_check(client.redis, keys, ids, timeout=60).assert_ok()
    assert all(report.results[i].ok for i in ids)
    assert 100 <= client.redis.xlen(reply_to) <= 200 and 100 <= client.redis.xlen(keys.dead) <= 200


def test_one_read_brings_in_a_bounded_number_of_bytes(redis_server):
    """Fault 15: a read asks for at most --max-read-bytes / --max-entry-bytes entries; huge entries (which Redis
    sends whole) are then taken one at a time, also the first ones to wake an idle reader; a refused entry keeps
    none of its big fields in memory. Eight 100 MB entries once took a worker from 392 MB to 1 GB, 800 MB for good
    (`python tests/redis/memory_probe.py` measures the RSS of a worker process)."""
    import asyncio

    import redis.asyncio as aioredis

    from producer.wire.keys import NORMAL, Keys
    from producer.wire.schema import ErrorCode
    from worker.loop.consumer import Consumer

    async def scenario() -> list[list[int]]:
        client, keys = aioredis.from_url(redis_server.url), Keys()
        consumer = Consumer(client, keys, "w-bytes", max_entry_bytes=1000, max_read_bytes=4000)  # 4 per read
        await consumer.ensure_groups()
        stream, sizes = keys.requests_in(NORMAL), []
        async with client.pipeline(transaction=True) as pipe:  # they arrive together, as one burst
            for n in range(3):
                pipe.xadd(stream, {"body": b'{"id": "huge-%d", "pad": "' % n + b"x" * 5000 + b'"}'})
            for n in range(6):
                pipe.xadd(stream, {"body": b'{"id": "small-%d"}' % n})
            await pipe.execute()
        while deliveries := await consumer.read(NORMAL, 64, 100):
            sizes.append([len(d.body or b"") for d in deliveries])
            for delivery in deliveries:
                huge = delivery.request_id.startswith("huge")
                assert (delivery.invalid_code is ErrorCode.TOO_LARGE) == huge, delivery
                assert delivery.body == b"" if huge else delivery.body.startswith(b'{"id": "small')
        await client.aclose()
        return sizes

    sizes = asyncio.run(scenario())
    # one at a time while huge ones come (the first to wake the reader too), then at most four per read
    assert [len(read) for read in sizes] == [1, 1, 1, 1, 4, 1], sizes


def test_a_dead_planner_process_costs_no_request(redis_server, inprocess):
    """A planner process killed (the OOM killer, a crash in a decoder) broke the planner pool for good: every request
    after it was dead-lettered within milliseconds while the worker reported ready. The pool is replaced now, the
    entries it held are planned again, and nothing is lost or retried; the death is counted."""
    worker = inprocess(redis_server.url, planner_processes=2, max_deliveries=2).start()
    client = Client(redis_server.url)
    first = client.submit_many(batch(3, "before"))
    assert all(wait_and_check(client.redis, client.keys, first, timeout=60).assert_ok().results[i].ok for i in first)
    # This worker's own planner processes (a pool's, by its private table: other tests' may still be exiting).
    planners = list(worker.daemon.planner.pool._processes)
    assert planners, "the worker plans in processes"
    os.kill(planners[0], signal.SIGKILL)
    # The pool learns of the death on a thread of its own: requests sent before that could all be planned by the
    # surviving process, and the broken pool replaced (and counted) only at a later submit. Wait for it, not a time.
    wait_for(lambda: worker.daemon.planner.pool._broken, 30, what="the pool broken by its planner's death")
    ids = client.submit_many(batch(8, "after"))
    report = wait_and_check(client.redis, client.keys, ids, timeout=120).assert_ok()
    assert all(report.results[i].ok for i in ids), [report.results[i].error for i in ids]
    assert worker.metric("dq_planner_crashes_total") == 1
    assert worker.metric("dq_dead_letters_total") == 0 and worker.metric("dq_retries_total") == 0
    assert worker.alive and status(worker.daemon.snapshot())["ready"]
    worker.stop()


def test_two_requests_queued_under_one_id_each_get_a_reply(redis_server, inprocess):
    """Two requests under one id, both queued before either was answered: the one whose publication lost the race
    got nothing on its reply stream, uncounted. It is answered as a reused id is at planning now: id_conflict for
    another request, a replay for the same one."""
    client = Client(redis_server.url)
    keys = client.keys
    inprocess(redis_server.url).burst()  # the group, before the entries
    sent = {"a": ("ticket-7", "I was charged twice"), "b": ("ticket-7", "Thanks, all good"),
            "c": ("ticket-8", "the same"), "d": ("ticket-8", "the same")}
    for name, (request_id, state) in sent.items():
        client.redis.xadd(keys.requests, {"body": json.dumps({"id": request_id, "state": state, "questions": {
            "q": {"type": "noul"}}, "reply_to": keys.reply_prefix + name})})
    worker = inprocess(redis_server.url).burst()
    replies = replies_on(client, sent)
    assert all(len(got) == 1 for got in replies.values()), replies
    conflict = [r for name in "ab" for r in replies[name] if r["status"] == "error"]
    assert len(conflict) == 1 and conflict[0]["error"]["code"] == "id_conflict"
    assert [r["status"] for name in "cd" for r in replies[name]] == ["ok", "ok"]
    assert sum(bool(r.get("replay")) for name in "cd" for r in replies[name]) == 1
    assert worker.metric("dq_reused_ids_total") == 2


def test_entries_of_two_lanes_with_the_same_id_are_told_apart(redis_server, inprocess):
    """Who published was named by the kind of stream and the entry id: the high and the normal lane's streams can
    hold the same entry id, so of two requests under one id whose entries had the same id in both lanes, the
    loser took the winner's publication for its own and replied with the other request's answer as ok."""
    client = Client(redis_server.url)
    keys = client.keys
    inprocess(redis_server.url).burst()  # the group, before the entries
    for lane, state in (("high", "I was charged twice"), ("normal", "Thanks, all good")):
        client.redis.xadd(keys.requests_in(lane), {"body": json.dumps({
            "id": "ticket-9", "state": state, "questions": {"q": {"type": "noul"}},
            "reply_to": keys.reply_prefix + lane})}, id="1-1")
    inprocess(redis_server.url).burst()
    replies = replies_on(client, ("high", "normal"))
    assert sorted(r.get("error", {}).get("code", r["status"]) for got in replies.values() for r in got) == [
        "id_conflict", "ok"], replies


def test_an_input_that_kills_its_planner_is_dead_lettered_and_the_worker_stays(redis_server, inprocess, monkeypatch):
    """Each delivery of an input that kills its planner process costs two deaths (in the pool, then alone): counted
    as deaths in a row, the worker exited 70 at the third delivery, before the input was dead-lettered, and its
    entries waited for a reclaim. One culprit counts once now: dead-lettered, and the worker serves on."""
    import faulty_worker
    from worker.plan import planner

    monkeypatch.setattr(planner, "_plan_in_process", faulty_worker.plan_or_die)
    worker = inprocess(redis_server.url, planner_processes=1, max_deliveries=3).start()
    client = Client(redis_server.url)
    # With an image: a lone entry without one is planned in the worker's thread, one with one always in a process.
    [killer] = client.submit_many([{"id": "killer", "state": faulty_worker.PLANNER_KILLER.decode(),
                                    "questions": {"q": {"type": "noul"}},
                                    "assets": {"img": {"type": "image", "format": "png", "data_base64": "AAAA"}}}])
    # alone: nothing planned between
    report = wait_and_check(client.redis, client.keys, [killer], timeout=180).assert_ok()
    assert report.results[killer].error.code == "dead_lettered" and worker.alive
    assert worker.metric("dq_planner_crashes_total") == 6  # two per delivery
    [after] = client.submit_many(batch(1, "after"))
    assert wait_and_check(client.redis, client.keys, [after], timeout=60).assert_ok().results[after].ok
    worker.stop()


def test_a_fanned_out_request_that_loses_the_race_under_its_id_is_told(redis_server, inprocess):
    """A fanned-out request whose parts are in work when another request under its id is published: its parts
    found that result and said nothing, and its reply stream stayed empty. Each part that finds it says so now."""
    client = Client(redis_server.url)
    keys = client.keys
    # Its parts in one pack (it waits for them all) that outlasts the other worker's start and answer.
    slow = inprocess(redis_server.url, slow_s=8.0, max_wait_ms=2000, drain_timeout_s=60, **FANOUT).start()
    client.submit({**long_request("ticket-77"), "reply_to": keys.reply_prefix + "long"})
    wait_for(lambda: slow.faults.slow_packs, 30, what="the long request's parts in work")
    slow.daemon.stop()  # it finishes its parts, and takes nothing new
    time.sleep(1.0)  # once a read it had begun is over (its BLOCK is 0.1 s): the short request is the other's
    [short] = client.submit_many([{"id": "ticket-77", "state": "short", "questions": {"q": {"type": "noul"}},
                                   "reply_to": keys.reply_prefix + "short"}])
    fast = inprocess(redis_server.url, **FANOUT).start()
    assert client.wait(short, timeout=30).ok
    assert slow.faults.slow_packs == 1 and slow.daemon.loop.held, "the long request's parts are still in work"
    slow.join(30)
    fast.stop()
    wait_and_check(client.redis, keys, [short], timeout=30).assert_ok()  # and nothing left: the parts settled too
    replies = replies_on(client, ("long", "short"))
    assert [r["status"] for r in replies["short"]] == ["ok"]
    # Each part that found the other's result says so: a reply at least once, all of them id_conflict.
    assert replies["long"] and {r["error"]["code"] for r in replies["long"]} == {"id_conflict"}, replies
    assert slow.metric("dq_reused_ids_total", outcome="conflict") == len(replies["long"])
