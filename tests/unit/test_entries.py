"""Stream entries parsed once, when taken (worker/entries.py): what a delivery names, and a clear reason for each bad
field; a request's identity from the one parse of its body (``identity_of``, the planner's). And the Redis side of
the worker loads without the model's libraries."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from producer.wire.digest import body_digest
from producer.wire.keys import MAX_BODY_BYTES, Keys
from producer.wire.schema import ErrorCode
from worker.entries import PARTS, REQUESTS, Delivery, Identity
from worker.entries import Job, identity_of

ROOT = Path(__file__).resolve().parents[2]
KEYS = Keys("dq")
REPLY = KEYS.reply_prefix + "mine"


def request(body: bytes | None, **extra: bytes) -> Delivery:
    fields = {b"body": body} if body is not None else {}
    return Delivery.parse(REQUESTS, KEYS.requests, "1700000000123-4", {**fields, **_encoded(extra)}, 1)


def identity(entry: Delivery, stored_body: bytes | None = None) -> Identity:
    return identity_of(KEYS, Job.of(entry, stored_body))[0]


def part(**fields: bytes) -> Delivery:
    good = {"request_id": b"r-1", "part": b"1", "parts": b"3", "questions": b'["a", "b"]', "enqueued_ms": b"1234"}
    return Delivery.parse(PARTS, KEYS.parts, "1700000000999-0", _encoded({**good, **fields}), 2)


def _encoded(fields: dict[str, bytes | None]) -> dict[bytes, bytes]:
    return {name.encode(): value for name, value in fields.items() if value is not None}


def test_a_request_entry_names_its_id_reply_stream_and_enqueue_time():
    entry = request(json.dumps({"id": "r-1", "reply_to": REPLY, "state": "x"}).encode())
    assert (entry.request_id, entry.enqueued_ms) == ("r-1", 1700000000123)  # its leading id: not parsed here
    assert identity(entry) == Identity("r-1", REPLY)
    assert entry.invalid is None and entry.questions is None and (entry.part, entry.parts) == (0, 1)
    assert entry.body is not None and not entry.payload_gone and entry.stream == "requests"


@pytest.mark.parametrize("body", [b"{broken", b"\xff\xfe", b"[1, 2]", b'"text"', b"[" * 5000,
                                  json.dumps({"id": "a{b}"}).encode(), json.dumps({"id": 7}).encode(),
                                  json.dumps({"id": "r-1\n"}).encode(), json.dumps({"id": "x" * 129}).encode(),
                                  json.dumps({"id": "1700000000999-0"}).encode(), b'{"id": "r-1", "state": ',
                                  b'{"id": "r-1", "state": "\xff"}',
                                  '{"id": "r-1", "state": "\u00e9"}'.encode("utf-16")])
def test_a_request_without_a_usable_id_is_answered_under_its_entry_id(body):
    """No id, or one that is not valid (a trailing newline, too long, shaped like a stream entry id, a body that
    is not UTF-8): the entry id names the request."""
    entry = request(body)
    assert identity(entry) == Identity("1700000000123-4")
    assert entry.invalid is None  # the body itself is the planner's to judge, with an error result


@pytest.mark.parametrize("reply_to", ["someone:else", "dq:v1:result:{x}", "other:v1:reply:x", 5, "dq:v1:reply:",
                                      "dq:v1:reply:a{b}", "dq:v1:reply:x\n", "dq:v1:reply:a b",
                                      "dq:v1:reply:" + "x" * 129, "dq:v1:result:{x:reply:y}", "dq:v1:reply"])
def test_only_this_deployments_reply_streams_are_replied_to(reply_to):
    assert identity(request(json.dumps({"id": "r-1", "reply_to": reply_to}).encode())).reply_to is None


def test_a_reply_stream_at_the_length_limit_is_replied_to():
    longest = KEYS.reply_prefix + "a.b_c:d-" * 16
    assert identity(request(json.dumps({"id": "r-1", "reply_to": longest}).encode())).reply_to == longest


def test_a_request_entry_has_one_field():
    """Any other field (an enqueue time, anything) is refused, named; the request is still named by its id."""
    body = json.dumps({"id": "r-1", "reply_to": REPLY}).encode()
    for extra in ({"enqueued_ms": b"soon"}, {"enqueued_ms": b"1"}, {"priority": b"9"}):
        entry = request(body, **extra)
        assert entry.invalid.startswith(f"field {next(iter(extra))!r} is not a field of requests entries")
        assert (identity(entry), entry.answerable) == (Identity("r-1", REPLY), True)
    entry = Delivery.parse(REQUESTS, KEYS.requests, "1-1", {b"\xff\xfe": b"x", b"body": body}, 1)
    assert "is not a field" in entry.invalid and entry.request_id == "r-1"
    entry = request(None, other=b"field")
    assert entry.invalid.startswith("field 'other' is not a field") and entry.request_id == "1700000000123-4"


def test_every_field_counts_towards_the_size_limit_and_a_large_entry_is_not_parsed():
    body = json.dumps({"id": "big-1", "reply_to": REPLY, "state": "x"}).encode()
    small = Delivery.parse(REQUESTS, KEYS.requests, "5-0", {b"body": body}, 1, max_bytes=1000)
    assert small.invalid is None and small.size == len(body) + 4
    big = Delivery.parse(REQUESTS, KEYS.requests, "5-0", {b"body": body, b"pad": b"x" * 2000}, 1,
                         max_bytes=1000)
    assert big.invalid.startswith("the entry is 2") and big.invalid_code == ErrorCode.TOO_LARGE
    # The leading id only (as the client writes it): never parsed; digested as read, before its body is let go, so
    # that its too_large result is its request's (a producer takes its body's digest as its own: digest.py).
    assert identity(big) == Identity("big-1", digest=body_digest(body)) and big.fields[b"body"] == body
    later = json.dumps({"state": "x" * 2000, "id": "big-2"}).encode()
    assert Delivery.parse(REQUESTS, KEYS.requests, "5-0", {b"body": later}, 1, 1000).request_id == "5-0"



def test_a_body_at_the_producers_limit_is_taken():
    """The producers send bodies of up to MAX_BODY_BYTES, the default --max-entry-bytes: such an entry was refused
    too_large for its field name's four bytes, after the producer had queued it."""
    head = json.dumps({"id": "at-limit", "state": ""}).encode()
    body = head[:-2] + b"x" * (MAX_BODY_BYTES - len(head)) + head[-2:]
    assert len(body) == MAX_BODY_BYTES
    entry = Delivery.parse(REQUESTS, KEYS.requests, "5-0", {b"body": body}, 1, max_bytes=MAX_BODY_BYTES)
    assert entry.invalid is None
    over = Delivery.parse(REQUESTS, KEYS.requests, "5-0", {b"body": body + b" " * 2048}, 1, MAX_BODY_BYTES)
    assert over.invalid_code == ErrorCode.TOO_LARGE

def test_a_prompt_entry_names_its_request_part_and_questions():
    entry = part()
    assert (entry.request_id, entry.part, entry.parts, entry.questions) == ("r-1", 1, 3, ["a", "b"])
    assert entry.enqueued_ms == 1234 and entry.invalid is None
    # Its reply stream and context are its request's, from the body stored when it fanned out; its id is its own.
    stored = json.dumps({"id": "other", "reply_to": REPLY, "metadata": {"k": 1}}).encode()
    assert identity(entry, stored) == Identity("r-1", REPLY, {"k": 1})
    assert identity(entry, None) == Identity("r-1")  # the stored body is gone
    assert entry.body is None and entry.deliveries == 2


@pytest.mark.parametrize("fields, field", [
    ({"part": b"first"}, "part"),
    ({"part": b"3"}, "part"),
    ({"part": b"-1"}, "part"),
    ({"part": b" 1"}, "part"),
    ({"parts": None}, "parts"),
    ({"parts": b"0"}, "parts"),
    ({"parts": b"65"}, "parts"),
    ({"parts": b"9" * 5000}, "parts"),
    ({"questions": b"[broken"}, "questions"),
    ({"questions": b'{"a": 1}'}, "questions"),
    ({"questions": b"[1, 2]"}, "questions"),
    ({"questions": b"[]"}, "questions"),
    ({"questions": b'["a", "a"]'}, "questions"),
    ({"questions": b"\xff"}, "questions"),
    ({"enqueued_ms": b"soon"}, "enqueued_ms"),
    ({"enqueued_ms": b"1_000"}, "enqueued_ms"),
    ({"reply_to": b"dq:v1:reply:x"}, "reply_to"),
])
def test_each_bad_prompt_field_is_named_and_the_delivery_stays_usable(fields, field):
    entry = part(**fields)
    assert entry.invalid is not None and entry.invalid.startswith(f"field {field!r} ")
    assert entry.request_id == "r-1" and entry.answerable
    assert isinstance(entry.enqueued_ms, int) and 0 <= entry.part < entry.parts


@pytest.mark.parametrize("request_id", [None, b"\xff", b"a{b}", b"r-1\n", b"", b"x" * 129])
def test_a_part_without_a_usable_request_id_answers_nothing(request_id):
    entry = part(request_id=request_id)
    assert entry.invalid.startswith("field 'request_id' ") and not entry.answerable


TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_the_callers_context_is_read_once_and_only_when_valid():
    found = identity(request(json.dumps({"id": "r-1", "state": "x", "metadata": {"tenant": "acme"},
                                         "traceparent": TRACE, "questions": "not even questions"}).encode()))
    assert (found.metadata, found.traceparent) == ({"tenant": "acme"}, TRACE)  # kept for the error result's echo
    assert found.log_fields == {"request_id": "r-1", "traceparent": TRACE}
    for bad in ({"metadata": ["a"], "traceparent": TRACE.upper()}, {"metadata": {"k": "x" * 5000}, "traceparent": 7},
                {"metadata": "tenant", "traceparent": TRACE + "\n"}):
        found = identity(request(json.dumps({"id": "r-2", "state": "x", **bad}).encode()))
        assert (found.metadata, found.traceparent) == (None, None) and found.log_fields == {"request_id": "r-2"}
    # A part carries its request's traceparent as a field of its own (for logs; a bad one is only left out).
    assert part(traceparent=TRACE.encode()).identity.traceparent == TRACE
    assert part(traceparent=b"\xff junk").identity.traceparent is None and part(traceparent=b"junk").invalid is None
    assert part().identity == Identity("r-1")


def test_a_trimmed_entry_has_no_payload():
    assert Delivery.parse(PARTS, KEYS.parts, "1-0", {}, 3).payload_gone


def test_the_redis_side_of_the_worker_loads_without_torch():
    """Intake, results, publication and the entries (and the Redis benchmark built on them) import no torch, PIL or
    transformers: ops/redis_bench.py runs where the model's libraries are not installed."""
    code = ("import sys; sys.path.insert(0, 'ops'); "
            "import worker.loop.intake, worker.loop.lifecycle, worker.loop.publisher, "
            "worker.outcomes, worker.entries, redis_bench; print(sorted(m for m in ('torch', 'PIL', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_an_entry_id_ahead_of_the_clock_is_not_believed():
    """A producer may XADD with an id of its choosing: one far ahead would make this entry's (and every later
    entry's) queue wait 0. Its enqueue time is capped at when it was taken, and the delivery says so."""
    import time

    future = int(time.time() * 1000) + 600_000
    entry = Delivery.parse(REQUESTS, KEYS.requests, f"{future}-0", {b"body": b"{}"}, 1)
    assert entry.ahead and entry.enqueued_ms <= int(entry.taken * 1000)
    now = Delivery.parse(REQUESTS, KEYS.requests, f"{int(time.time() * 1000) - 5}-0", {b"body": b"{}"}, 1)
    assert not now.ahead
