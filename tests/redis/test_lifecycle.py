"""An entry's life (worker/loop/lifecycle.py), in process against a real server: accepted, planned, queued and
published; a failed pack retried with its planned task, then dead-lettered at the cap; a deadline passed while
queued; a long request fanned out into parts; a bad entry answered where its body says; every entry let go.

Each test runs a real Daemon in this process (tests/redis/inprocess.py) on the tiny checkpoint, most of them as a
burst: the worker returns once its streams are drained. Assertions are on Redis' state and the worker's metrics.
"""

from __future__ import annotations

import json
import time

import pytest

from faults import FANOUT, batch, long_request, wait_for
from producer.admin.audit import wait_and_check
from producer.client import Client
from producer.wire.keys import Field
from producer.wire.result import Result

pytestmark = pytest.mark.redis

POISON = "POISON-5e1f"


def drained(client: Client) -> None:
    """Nothing left behind: every work stream empty, nothing pending, no per-request scratch keys."""
    keys = client.keys
    for stream in (keys.requests, keys.parts):
        assert client.redis.xlen(stream) == 0
        assert client.redis.xpending(stream, keys.group)["pending"] == 0


def test_requests_are_accepted_planned_computed_published_and_let_go(redis_server, inprocess):
    client = Client(redis_server.url)
    ids = client.submit_many(batch(9, "life"))
    worker = inprocess(redis_server.url).burst()
    report = wait_and_check(client.redis, client.keys, ids, timeout=30).assert_ok()
    assert all(report.results[i].ok for i in ids)
    assert worker.metric("dq_entries_read_total", stream="requests", how="read") == 9
    assert worker.metric("dq_results_total", status="ok") == 9
    assert worker.metric("dq_planning_seconds_count") == 9  # each body planned once
    assert worker.metric("dq_inflight_entries") == 0 and not worker.daemon.loop.held
    drained(client)


def test_a_failed_pack_is_retried_with_its_planned_task_and_answered(redis_server, inprocess):
    """The poison fails its pack once per delivery; at --max-deliveries 3 it is dead-lettered, while its pack mates
    (isolated by bisection) are answered. Each retry reuses the planned task: planning happens once per entry."""
    client = Client(redis_server.url)
    requests = batch(6, "mate")
    requests.insert(3, {"id": "poison", "state": f"This carries {POISON}.", "reply_to": client.keys.reply_prefix + "mine",
                        "metadata": {"ticket": 7}, "questions": {"q": {"type": "noul"}}})
    ids = client.submit_many(requests)
    worker = inprocess(redis_server.url, raise_on=POISON, max_deliveries=3).burst()
    report = wait_and_check(client.redis, client.keys, ids, timeout=30).assert_ok()
    poison = report.results["poison"]
    assert poison.error.code.value == "dead_lettered" and "3 deliveries" in poison.error.message
    assert poison.metadata == {"ticket": 7}  # the identity from the one parse of its body
    assert all(report.results[i].ok for i in ids if i != "poison")
    assert worker.metric("dq_retries_total") == 2 and worker.metric("dq_dead_letters_total") == 1
    assert worker.metric("dq_entries_read_total", stream="requests", how="retried") == 2
    assert worker.metric("dq_planning_seconds_count") == 7  # the poison was planned once, not per delivery
    [(_, dead)] = client.redis.xrange(client.keys.dead)
    assert dead[Field.DELIVERIES.encode()] == b"3" and b"injected fault" in dead[Field.REASON.encode()]
    [(_, reply)] = client.redis.xrange(client.keys.reply_prefix + "mine")  # the error result also went to its reply stream
    assert reply[Field.REPLY_ID.encode()] == b"poison"
    drained(client)


def test_an_entry_delivered_too_often_is_dead_lettered_with_its_identity(redis_server, inprocess):
    """An entry already delivered --max-deliveries times (its workers died mid-pack) is not planned again: it is
    dead-lettered, and its error result goes where its body says."""
    client = Client(redis_server.url)
    keys = client.keys
    client.redis.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
    body = json.dumps({"id": "crashy", "state": "x", "reply_to": keys.reply_prefix + "mine", "questions": {"q": {"type": "noul"}}})
    client.redis.xadd(keys.requests, {Field.BODY: body})
    for _ in range(3):  # three workers took it and died
        client.redis.xreadgroup(keys.group, "dead-worker", {keys.requests: "0" if _ else ">"})
    worker = inprocess(redis_server.url, max_deliveries=3, claim_idle_ms=1).burst()
    report = wait_and_check(client.redis, keys, ["crashy"], timeout=30).assert_ok()
    assert report.results["crashy"].error.code.value == "dead_lettered"
    assert worker.metric("dq_planning_seconds_count") == 0 and worker.metric("dq_dead_letters_total") == 1
    assert client.redis.xlen(keys.reply_prefix + "mine") == 1
    drained(client)


def test_a_deadline_that_passes_while_queued_is_answered_without_compute(redis_server, inprocess):
    client = Client(redis_server.url)
    worker = inprocess(redis_server.url, slow_s=1.5, max_wait_ms=1).start()
    client.submit({"id": "slow-first", "state": "x", "questions": {"q": {"type": "noul"}}})
    time.sleep(0.5)  # its pack is on the (slow) engine now
    client.submit({"id": "late", "state": "y", "questions": {"q": {"type": "noul"}},
                   "deadline_ms": int(time.time() * 1000) + 300})
    report = wait_and_check(client.redis, client.keys, ["slow-first", "late"], timeout=30).assert_ok()
    assert report.results["slow-first"].ok
    late = report.results["late"]
    assert late.error.code.value == "deadline_exceeded" and "before compute" in late.error.message
    worker.stop()
    assert worker.metric("dq_retries_total") == 0
    drained(client)


def test_a_long_request_fans_out_and_its_parts_merge_into_one_result(redis_server, inprocess):
    client = Client(redis_server.url)
    ids = client.submit_many([long_request("long-1"), *batch(3, "short")])
    worker = inprocess(redis_server.url, **FANOUT).burst()
    report = wait_and_check(client.redis, client.keys, ids, timeout=60).assert_ok()
    long = report.results["long-1"]
    assert long.ok and long.usage.parts > 1 and list(long.answers) == [f"q{i}" for i in range(24)]
    assert worker.metric("dq_fanouts_total") == 1
    assert worker.metric("dq_entries_read_total", stream="chunks", how="read") == long.usage.parts
    assert not client.redis.exists(client.keys.shares("long-1"), client.keys.body("long-1"))
    drained(client)


def test_a_dead_lettered_part_answers_its_request_on_its_reply_stream(redis_server, inprocess):
    """A part that fails every delivery: its request's error result goes to the request's reply stream, which the
    part learns from the request body stored when it fanned out."""
    client = Client(redis_server.url)
    poisoned = long_request("long-p")
    poisoned["questions"]["q5"]["instructions"] = f"Question {POISON}?"
    poisoned["reply_to"] = client.keys.reply_prefix + "parts"
    client.submit(poisoned)
    inprocess(redis_server.url, raise_on=POISON, max_deliveries=2, **FANOUT).burst()
    report = wait_and_check(client.redis, client.keys, ["long-p"], timeout=60).assert_ok()
    assert report.results["long-p"].error.code.value == "dead_lettered"
    [(_, reply)] = client.redis.xrange(client.keys.reply_prefix + "parts")
    assert reply[Field.REPLY_ID.encode()] == b"long-p"
    drained(client)


def test_a_bad_field_is_answered_where_the_body_says(redis_server, inprocess):
    client = Client(redis_server.url)
    keys = client.keys
    body = json.dumps({"id": "extra", "state": "x", "reply_to": keys.reply_prefix + "bad", "questions": {"q": {"type": "noul"}}})
    client.redis.xadd(keys.requests, {Field.BODY: body, "priority": "high"})
    inprocess(redis_server.url).burst()
    report = wait_and_check(client.redis, keys, ["extra"], timeout=30).assert_ok()
    assert report.results["extra"].error.code.value == "invalid_request"
    assert report.results["extra"].error.message.startswith("field 'priority' is not a field of requests entries")
    assert client.redis.xlen(keys.reply_prefix + "bad") == 1
    drained(client)


def test_a_reused_id_is_a_replay_or_a_conflict_and_is_not_computed_again(redis_server, inprocess):
    """A business key reused: the same request again is answered with the stored result marked as a replay; a
    different request under the id is computed nothing and answered id_conflict, on its reply stream and by the
    client's decide. The stored result stays the first one's."""
    client = Client(redis_server.url)
    keys = client.keys
    first = {"id": "ticket-0", "state": "Refund me.", "questions": {"refund": {"type": "noul"}},
             "metadata": {"v": 1}}
    worker = inprocess(redis_server.url).start()
    stored = client.decide(first, timeout=30)
    assert stored.ok and stored.digest and stored.replay is None
    tokens = worker.metric("dq_tokens_total")
    again = client.decide({**first, "reply_to": keys.reply_prefix + "again", "deadline_ms": 2 ** 47}, timeout=30)
    assert again == stored  # the result stream is unchanged: the first one's
    changed = {**first, "state": "All good now.", "questions": {"tone": {"type": "noul"}},
               "reply_to": keys.reply_prefix + "changed"}
    conflict = client.decide(changed, timeout=30)
    assert conflict.error.code.value == "id_conflict" and stored.digest in conflict.error.message
    # decide returns as soon as the stored result is there: the worker's replies to both come after
    wait_for(lambda: client.redis.xlen(keys.reply_prefix + "changed") == 1, 20, what="the conflict's reply")
    wait_for(lambda: client.redis.xlen(keys.reply_prefix + "again") == 1, 20, what="the replay's reply")
    [(_, replayed)] = client.redis.xrange(keys.reply_prefix + "again")
    replay = Result.model_validate_json(replayed[b"body"])
    assert replay.replay is True and replay.answers == stored.answers and replay.metadata == {"v": 1}
    [(_, refused)] = client.redis.xrange(keys.reply_prefix + "changed")
    assert Result.model_validate_json(refused[b"body"]).error.code.value == "id_conflict"
    assert worker.metric("dq_tokens_total") == tokens  # neither was computed
    assert worker.metric("dq_reused_ids_total", outcome="replay") == 1
    assert worker.metric("dq_reused_ids_total", outcome="conflict") == 1
    assert client.redis.xlen(keys.result("ticket-0")) == 1
    worker.stop()
    drained(client)
