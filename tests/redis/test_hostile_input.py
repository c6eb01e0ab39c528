"""Hostile stream entries against a real worker (in this process, its fatal exits recorded): fields a producer (or
anyone who can write a stream) controls, each answered at once with a clear error result under the right id, and
nothing written outside the request's own keys and its namespace's reply streams (watched through keyspace
notifications)."""

from __future__ import annotations

import json
import time

import pytest
from faults import FANOUT, batch, long_request
from keyspace import WrittenKeys

from producer.client import Client
from producer.admin.audit import wait_and_check
from producer.wire.keys import Keys

pytestmark = [pytest.mark.redis, pytest.mark.slow]

WORKER_SETTINGS = dict(max_entry_bytes=200_000, **FANOUT)
NOUL = {"q": {"type": "noul"}}
KEYS = Keys()
REPLY = KEYS.reply_prefix + "hostile"


def request(request_id: str | None = None, **extra) -> bytes:
    return json.dumps({**({"id": request_id} if request_id else {}), "state": "Refund me.", "questions": NOUL,
                       **extra}).encode()


def own_keys(ids) -> set[bytes]:
    """What work on these requests may write: the work and dead-letter streams, the heartbeats, their own keys
    (result, shares, body, record)."""
    shared = {KEYS.requests, KEYS.parts, KEYS.dead, KEYS.workers()}
    return {key.encode() for key in shared | {make(i) for i in ids
                                              for make in (KEYS.result, KEYS.shares, KEYS.body, KEYS.record)}}


class Watched:
    """A test's view: the client, the worker, the keys written; dead letters the test expects (bad input has none,
    and is never retried)."""

    def __init__(self, server, worker) -> None:
        self.client, self.worker, self.written = Client(server.url), worker, WrittenKeys(server.url)
        self.dead_letters = 0
        self.before = {name: worker.metric(name) for name in ("dq_retries_total", "dq_dead_letters_total")}

    def check(self) -> None:
        self.written.stop()
        assert self.worker.alive
        assert self.worker.metric("dq_retries_total") == self.before["dq_retries_total"]
        assert self.worker.metric("dq_dead_letters_total") == self.before["dq_dead_letters_total"] + self.dead_letters


@pytest.fixture
def watched(module_worker):
    watch = Watched(*module_worker)
    yield watch
    watch.check()


def error_of(report, request_id: str) -> tuple[str, str]:
    result = report.results[request_id]
    assert not result.ok, result
    return result.error.code.value, result.error.message


def test_bad_fields_are_answered_at_once_under_the_right_id(watched):
    """An extra field on a request entry (an enqueue time that is not a number made the worker exit 70), an id
    with a trailing newline (published under a key holding the newline), entry bytes over all fields."""
    client, written = watched.client, watched.written
    stream = client.keys.requests
    xadd = lambda **fields: client.redis.xadd(stream, fields).decode()  # noqa: E731
    xadd(body=request("extra-time"), enqueued_ms=b"soon")
    xadd(body=request("extra-any"), priority=b"9")
    newline = xadd(body=request("nl-1\n"))
    xadd(body=request("padded"), pad=b"x" * 250_000)  # the body is small; the entry is not
    late_id = xadd(body=json.dumps({"state": "x" * 250_000, "questions": NOUL, "id": "late-id"}).encode())
    no_body = xadd(other=b"field")
    good = client.submit_many(batch(3, "beside"))
    ids = ["extra-time", "extra-any", newline, "padded", late_id, no_body, *good]
    report = wait_and_check(client.redis, client.keys, ids, timeout=90).assert_ok()

    assert error_of(report, "extra-time") == ("invalid_request", "field 'enqueued_ms' is not a field of requests "
                                                                 "entries (body)")
    assert error_of(report, "extra-any")[1].startswith("field 'priority' is not a field")
    assert error_of(report, newline)[0] == "invalid_request" and "id must be" in error_of(report, newline)[1]
    assert error_of(report, "padded") == ("too_large", f"the entry is {len(request('padded')) + 250_007} bytes; "
                                                       "this worker takes a body of at most 200000 and 1024 bytes "
                                                       "besides (field names, a part's fields)")
    assert error_of(report, late_id)[0] == "too_large"  # its id is not first: the body is not parsed for it
    assert error_of(report, no_body)[1].startswith("field 'other' is not a field")
    assert all(report.results[i].ok for i in good)
    assert written.keys() <= own_keys(ids)  # no key with a newline in it, nothing else


def test_ids_shaped_like_entry_ids_are_refused(watched):
    """A custom id shaped like a stream entry id could be a later request's (one sent without an id): that request
    would be answered with the first one's result."""
    client, written = watched.client, watched.written
    stream = client.keys.requests
    future = f"{int(time.time() * 1000) + 600_000}-0"
    squatter = client.redis.xadd(stream, {"body": request(future, questions={"squat": {"type": "noul"}})}).decode()
    victim = client.redis.xadd(stream, {"body": request()}, id=future).decode()  # sent without an id, later
    report = wait_and_check(client.redis, client.keys, [squatter, victim], timeout=60).assert_ok()
    assert error_of(report, squatter)[0] == "invalid_request" and "stream entry id" in error_of(report, squatter)[1]
    assert report.results[victim].ok and list(report.results[victim].answers) == ["q"]  # its own answers
    assert written.keys() <= own_keys([squatter, victim])


def test_reply_to_is_this_namespaces_reply_streams_only(watched):
    """Other namespaces, other requests' keys (an id containing ':reply:' was one), braces, newlines, lengths:
    refused with invalid_request, nothing written there."""
    client, written = watched.client, watched.written
    victim = client.submit({"id": "v:reply:1", "state": "mine", "questions": NOUL})
    hostile = {"other-ns": "other:v1:reply:x", "into-result": "dq:v1:result:{v:reply:1}",
               "braces": "dq:v1:reply:{v:reply:1}", "newline": "dq:v1:reply:x\n", "empty": "dq:v1:reply:",
               "too-long": "dq:v1:reply:" + "x" * 129, "other-version": "dq:v2:reply:x", "bare": "dq:v1:reply"}
    for name, reply_to in hostile.items():
        client.redis.xadd(client.keys.requests, {"body": request(name, reply_to=reply_to)})
    longest = KEYS.reply_prefix + "r" * 128
    client.redis.xadd(client.keys.requests, {"body": request("longest", reply_to=longest)})
    ids = [victim, *hostile, "longest"]
    report = wait_and_check(client.redis, client.keys, ids, timeout=60).assert_ok()
    for name in hostile:
        code, message = error_of(report, name)
        assert code == "invalid_request" and "reply_to must be" in message, (name, message)
    assert report.results[victim].ok and client.redis.xlen(client.keys.result(victim)) == 1
    [(_, reply)] = client.redis.xrange(longest)
    assert reply[b"id"] == b"longest"
    assert written.keys() <= own_keys(ids) | {longest.encode()}


def test_bad_part_entries_answer_their_request_or_are_dead_lettered(watched):
    """A part entry is the workers', but anyone who can write the part stream can forge one: a bad field answers
    its request at once; a part naming no usable request is dead-lettered, and no result is written anywhere."""
    client, written = watched.client, watched.written
    prompts = client.keys.parts
    good = {"request_id": b"forged-1", "part": b"0", "parts": b"2", "questions": b'["q"]', "enqueued_ms": b"0"}
    client.redis.xadd(prompts, {**good, "part": b"7"})
    client.redis.xadd(prompts, {**good, "request_id": b"forged-2", "questions": b"[]"})
    client.redis.xadd(prompts, {**good, "request_id": b"forged-3", "reply_to": REPLY})
    orphans = [client.redis.xadd(prompts, {**good, "request_id": value}).decode() for value in (b"a{b}", b"\xff")]
    watched.dead_letters = 2
    report = wait_and_check(client.redis, client.keys, ["forged-1", "forged-2", "forged-3"], timeout=60).assert_ok()
    assert error_of(report, "forged-1") == ("invalid_request", "field 'part' is 7, outside 0..1")
    assert error_of(report, "forged-2")[1].startswith("field 'questions' is not a list")
    assert error_of(report, "forged-3")[1].startswith("field 'reply_to' is not a field of chunks entries")
    dead = [fields for _, fields in client.redis.xrange(client.keys.dead) if fields[b"entry_id"].decode() in orphans]
    assert len(dead) == 2 and all(b"request_id" in fields[b"reason"] for fields in dead)
    assert written.keys() <= own_keys(["forged-1", "forged-2", "forged-3"])


def test_a_fanned_out_request_past_its_deadline_still_replies(watched):
    """Its parts find the deadline passed: the error result goes to the reply stream too (it went nowhere)."""
    client, written = watched.client, watched.written
    reply = KEYS.reply_prefix + "deadline"
    body = long_request("late-long", questions=4) | {"reply_to": reply, "deadline_ms": 1000}
    client.redis.set(client.keys.body("late-long"), json.dumps(body))  # as its fan-out stored it
    for index, names in enumerate([["q0", "q1"], ["q2", "q3"]]):
        client.redis.xadd(client.keys.parts, {"request_id": "late-long", "part": index, "parts": 2,
                                               "questions": json.dumps(names), "enqueued_ms": 0})
    report = wait_and_check(client.redis, client.keys, ["late-long"], timeout=60).assert_ok()
    assert error_of(report, "late-long")[0] == "deadline_exceeded"
    [(_, fields)] = client.redis.xrange(reply)
    assert fields[b"id"] == b"late-long" and json.loads(fields[b"body"])["error"]["code"] == "deadline_exceeded"
    assert written.keys() <= own_keys(["late-long"]) | {reply.encode()}


def test_error_results_are_bounded_whatever_the_request(watched):
    """Thousands of invalid questions (280k made a 33.5 MB error result, kept for a day)."""
    client = watched.client
    questions = {f"q{i}": {"type": "bogus"} for i in range(3000)}
    client.redis.xadd(client.keys.requests, {"body": request("many-bad", questions=questions)})
    report = wait_and_check(client.redis, client.keys, ["many-bad"], timeout=60).assert_ok()
    code, message = error_of(report, "many-bad")
    assert code == "invalid_request" and len(message) <= 2000 and message.endswith("more problems")
    assert len(client.redis.xrange(client.keys.result("many-bad"))[0][1][b"body"]) < 3000


def test_entries_of_both_streams_with_the_same_entry_id_are_both_taken(watched):
    """The request and part streams give out the same time-sequence ids: an entry held under its id alone made the
    other stream's entry with that id pass for it, left pending until reclaimed a minute later (the fuzz test
    found it)."""
    client = watched.client
    same = f"{int(time.time() * 1000) + 7_200_000}-7"  # after any id the other tests made (one is 10 min ahead)
    client.redis.xadd(client.keys.parts, {"request_id": "twin-part", "part": "0", "parts": "2", "questions": "[]",
                                           "enqueued_ms": "0"}, id=same)
    client.redis.xadd(client.keys.requests, {"body": request("twin-request")}, id=same)
    report = wait_and_check(client.redis, client.keys, ["twin-part", "twin-request"], timeout=30).assert_ok()
    assert report.results["twin-request"].ok and error_of(report, "twin-part")[0] == "invalid_request"
