"""What a result stream holds answers its own request only, against a real worker (in this process) on each server:
every stored result carries its request's digest, error results too (producer/wire/digest.py), so a stored error
never answers a different request under the id; a result that no worker wrote (garbage, another id's) is counted,
logged and dead-lettered by the worker, never held, and is read as an id_conflict, never as an answer."""

from __future__ import annotations

import json
import time

import pytest
from faults import wait_for

from producer.client import Client
from producer.client.plans import prepare
from producer.wire.digest import body_digest
from producer.wire.keys import Field, Keys

pytestmark = pytest.mark.redis
KEYS = Keys()
NOUL = {"q": {"type": "noul", "instructions": "Is a refund asked for?"}}


def body(request_id: str, state: object = "Refund me.", **extra) -> dict:
    return {"id": request_id, "state": state, "questions": NOUL, **extra}


def stored(client: Client, request_id: str) -> dict:
    entry = client.redis.xrange(KEYS.result(request_id), count=1)
    return json.loads(entry[0][1][b"body"]) if entry else {}


def test_an_expired_requests_error_never_answers_another_request_under_its_id(module_worker):
    """A request past its deadline is answered deadline_exceeded: that result carries its digest, so a different
    request sent later under the id is id_conflict (it was answered the old error, by Client.decide too), while the
    same request again gets its own stored result."""
    server, worker = module_worker
    client = Client(server.url)
    late = body("stale-1", deadline_ms=int(time.time() * 1000) - 1000)
    first = client.decide(late, timeout=60)
    assert first.error.code == "deadline_exceeded" and first.digest == prepare(late).digest
    assert stored(client, "stale-1")["digest"] == prepare(late).digest
    other = client.decide(body("stale-1", state="A corrected ticket."), timeout=60)
    assert other.error.code == "id_conflict" and other.answers is None, other
    assert Client(server.url).decide(late, timeout=60).error.code == "deadline_exceeded"  # the same request


def test_a_corrected_request_under_the_id_of_an_invalid_one_is_id_conflict(module_worker):
    """A body the worker refuses (from a producer that does not validate: a field the schema does not know) is
    answered invalid_request with its body's digest; the corrected request under the same id is id_conflict, never
    the old invalid_request."""
    server, worker = module_worker
    client = Client(server.url)
    raw = json.dumps(body("fixme-1", colour="red")).encode()
    client.redis.xadd(KEYS.requests, {Field.BODY: raw})
    refused = client.wait("fixme-1", timeout=60)
    assert refused.error.code == "invalid_request" and refused.digest == body_digest(raw)
    fixed = client.decide(body("fixme-1"), timeout=60)
    assert fixed.error.code == "id_conflict" and "fixme-1" in fixed.error.message, fixed
    assert stored(client, "fixme-1")["error"]["code"] == "invalid_request"  # the stored result stays


def test_a_result_without_a_digest_answers_no_request(module_worker):
    """A stored result without a digest (an older worker's error result, or written by something else) was taken
    for a match: now it answers nobody, at the worker (its reply: id_conflict) and at the client."""
    server, worker = module_worker
    client = Client(server.url)
    client.redis.xadd(KEYS.result("undigested-1"), {Field.BODY: json.dumps(
        {"id": "undigested-1", "status": "error", "error": {"code": "invalid_request", "message": "old"}})})
    reply = KEYS.reply_prefix + "undigested"
    answer = client.decide(body("undigested-1", reply_to=reply), timeout=60)
    assert answer.error.code == "id_conflict" and "without a digest" in answer.error.message, answer
    wait_for(lambda: client.redis.xlen(reply), timeout=30, what="the worker's reply")
    replied = json.loads(client.redis.xrange(reply)[0][1][b"body"])
    assert replied["error"]["code"] == "id_conflict" and "no known request" in replied["error"]["message"]


def test_a_null_state_is_sent_as_null(module_worker):
    """``"state": null`` was dropped by the client's serialisation, and the worker answered "state: Field
    required"."""
    server, _ = module_worker
    client = Client(server.url)
    assert json.loads(prepare(body("null-state-1", state=None)).body)["state"] is None
    result = client.decide(body("null-state-1", state=None), timeout=60)
    assert result.ok, result


def test_an_unreadable_stored_result_is_dead_lettered_never_held_and_read_as_id_conflict(module_worker):
    """A result stream entry that is no result of its id (written with a worker credential, or without ACLs): the
    planner failed reading it and the entry stayed held for ever, its idle time kept fresh, the worker ready and
    unable to drain. Now the entry is dead-lettered (counted, logged), the worker holds nothing, and readers get an
    id_conflict naming why. A request refused as invalid under such an id goes the same way (its publication finds
    the garbage), and so does one whose id holds another id's result."""
    server, worker = module_worker
    client = Client(server.url)
    before = worker.metric("dq_unreadable_results_total"), worker.metric("dq_dead_letters_total")
    dead_before = client.redis.xlen(KEYS.dead)
    client.redis.xadd(KEYS.result("garbled-1"), {Field.BODY: b"\xff not a result"})
    client.redis.xadd(KEYS.result("garbled-2"), {"other": "no body"})
    client.redis.xadd(KEYS.result("garbled-3"), {Field.BODY: json.dumps({"id": "someone-else", "status": "ok"})})
    answered = client.decide(body("garbled-1"), timeout=60)
    assert answered.error.code == "id_conflict" and "no readable result" in answered.error.message
    client.redis.xadd(KEYS.requests, {Field.BODY: json.dumps(body("garbled-2", colour="red"))})  # invalid too
    client.submit(body("garbled-3"))
    wait_for(lambda: worker.metric("dq_unreadable_results_total") >= before[0] + 3, timeout=30,
             what="three unreadable results counted")
    wait_for(lambda: worker.metric("dq_inflight_entries") == 0, timeout=30, what="the worker to hold nothing")
    assert worker.metric("dq_dead_letters_total") >= before[1] + 3 and worker.alive
    letters = client.redis.xrange(KEYS.dead)[dead_before:]
    reasons = [fields[b"reason"].decode() for _, fields in letters]
    for request_id in ("garbled-1", "garbled-2", "garbled-3"):
        assert any(request_id in reason and "no result can be published" in reason for reason in reasons), reasons
    assert worker.get("/readyz")[0] == 200
    for request_id in ("garbled-2", "garbled-3"):
        assert client.fetch(request_id).error.code == "id_conflict"
