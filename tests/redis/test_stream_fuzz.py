"""Hypothesis at the stream level, against a live worker (in this process): entries of any shape written straight into the streams a
producer can write (the request stream; and the part stream, the workers' own, which a leaked worker credential
or a bug could write), with extra, missing and malformed fields and values, bytes that are not UTF-8, ids and
``reply_to`` values at and past every boundary.

Each batch checks, from outside: the worker never exits (where a process would) and ends ready with nothing held; every request gets
exactly one result, its own (the id the wire rules give it, written here independently of the worker's code);
and nothing is written outside the requests' own keys, the work and dead-letter streams, the heartbeats and the
namespace's reply streams the requests named (keyspace notifications see every write, whoever made it).
"""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from faults import FANOUT, long_request, wait_released
from keyspace import WrittenKeys
from producer.client import Client
from producer.admin.audit import wait_and_check
from producer.wire.keys import Keys

pytestmark = [pytest.mark.redis, pytest.mark.slow]

WORKER_SETTINGS = dict(max_entry_bytes=100_000, **FANOUT)
KEYS = Keys()
# The wire rules (docs/PROTOCOL.md), restated: a custom id, and a reply stream of this namespace.
CUSTOM_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
ENTRY_ID = re.compile(r"[0-9]+-[0-9]+")
REPLY_SUFFIX = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
ALPHABET = "abcXYZ019._:-"
_batches = itertools.count()


def custom_id(value: object) -> bool:
    return isinstance(value, str) and bool(CUSTOM_ID.fullmatch(value)) and not ENTRY_ID.fullmatch(value)


def own_reply_stream(value: object) -> bool:
    return (isinstance(value, str) and value.startswith(KEYS.reply_prefix)
            and bool(REPLY_SUFFIX.fullmatch(value[len(KEYS.reply_prefix):])))


def text_of(length: int) -> st.SearchStrategy[str]:
    return st.text(ALPHABET, min_size=length, max_size=length)


# Ids at and past every boundary: lengths 1, 127, 128, 129, the alphabet's edges, a trailing newline, braces and
# spaces, entry-id shapes, not strings at all.
ids = st.one_of(
    st.sampled_from([1, 2, 127, 128, 129, 300]).flatmap(text_of),
    text_of(8).map(lambda s: s + "\n"), text_of(8).map(lambda s: s + "{x}"), text_of(8).map(lambda s: s + " x"),
    st.tuples(st.integers(0, 2 ** 48), st.integers(0, 99)).map(lambda t: f"{t[0]}-{t[1]}"),
    st.just(""), st.integers(), st.none(), st.lists(st.integers(), max_size=2),
)
reply_tos = st.one_of(
    st.sampled_from([1, 128, 129]).flatmap(text_of).map(lambda s: KEYS.reply_prefix + s),
    text_of(6).map(lambda s: KEYS.reply_prefix + s + "\n"), text_of(6).map(lambda s: KEYS.reply_prefix + "{" + s + "}"),
    text_of(6).map(lambda s: "other:v1:reply:" + s), text_of(6).map(lambda s: KEYS.result(s)),
    st.sampled_from([KEYS.reply_prefix, KEYS.reply_prefix[:-1], KEYS.requests, "dq:v2:reply:x"]),
    st.integers(), st.none(),
)
QUESTIONS = {"q": {"type": "noul", "instructions": "Spam?"}}
values = st.one_of(st.binary(max_size=40), st.text(max_size=20).map(str.encode),
                   st.integers().map(lambda i: str(i).encode()))
names = st.one_of(st.sampled_from([b"body", b"enqueued_ms", b"reply_to", b"id", b"part", b"request_id", b"\xff\xfe"]),
                  st.binary(min_size=1, max_size=12))


@st.composite
def bodies(draw) -> bytes | None:
    """A request body: valid but for its queue fields, malformed JSON, bytes that are not UTF-8, or none."""
    request: dict = {"state": draw(st.text(max_size=40)), "questions": QUESTIONS}
    for field, strategy in (("id", ids), ("reply_to", reply_tos)):
        if draw(st.booleans()):
            request[field] = draw(strategy)
    if draw(st.integers(0, 9)) == 0:
        request = long_request("fanned", questions=draw(st.integers(2, 8))) | {
            key: value for key, value in request.items() if key in ("id", "reply_to")}
    if draw(st.integers(0, 9)) == 0:
        request["unknown"] = 1
    raw = json.dumps(request).encode()
    kind = draw(st.sampled_from(["json"] * 6 + ["truncated", "not-utf8", "array", "none"]))
    broken = raw.replace(b'"state": "', b'"state": "\xff', 1)
    return {"json": raw, "truncated": raw[: len(raw) // 2], "not-utf8": broken, "array": b"[" + raw + b"]",
            "none": None}[kind]


@st.composite
def request_entries(draw) -> dict[bytes, bytes]:
    fields: dict[bytes, bytes] = {}
    body = draw(bodies())
    if body is not None:
        fields[b"body"] = body
    for name, value in draw(st.lists(st.tuples(names, values), max_size=2)):
        if name != b"body" or body is None:
            fields[name] = value
    return fields or {b"body": b"{}"}


@st.composite
def prompt_entries(draw) -> dict[bytes, bytes]:
    good = {b"part": b"0", b"parts": b"2", b"questions": b'["q0"]', b"enqueued_ms": b"1"}
    fields = {name: draw(st.one_of(st.just(value), values)) for name, value in good.items() if draw(st.integers(0, 5))}
    fields[b"request_id"] = draw(st.one_of(st.just(b"prompt"), st.binary(max_size=10), text_of(129).map(str.encode)))
    for name, value in draw(st.lists(st.tuples(names, values), max_size=1)):
        fields.setdefault(name, value)
    return fields


entries = st.lists(st.one_of(request_entries().map(lambda f: ("requests", f)),
                             prompt_entries().map(lambda f: ("chunks", f))), min_size=10, max_size=30)


def expected_id(fields: dict[bytes, bytes], entry_id: str) -> str:
    """The id a request entry is answered under: its body's valid custom id, else its entry id."""
    try:
        body = json.loads(fields[b"body"].decode())
    except (KeyError, ValueError):
        return entry_id
    return body["id"] if isinstance(body, dict) and custom_id(body.get("id")) else entry_id


def named_reply(fields: dict[bytes, bytes]) -> str | None:
    try:
        body = json.loads(fields[b"body"].decode())
    except (KeyError, ValueError):
        return None
    return body.get("reply_to") if isinstance(body, dict) and own_reply_stream(body.get("reply_to")) else None


@settings(max_examples=50, deadline=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(entries)
def test_any_entry_on_any_stream_gets_its_own_one_result_and_writes_nowhere_else(module_worker, batch):
    server, worker = module_worker
    client = Client(server.url)
    written = WrittenKeys(server.url)
    tag = f"fz{next(_batches)}-"
    try:
        expected, replies, seen = [], set(), set()
        for n, (stream, fields) in enumerate(batch):
            if stream == "chunks":  # a forged part: it answers the request it names, if it names one
                if fields[b"request_id"] == b"prompt":
                    fields[b"request_id"] = f"{tag}c{n}".encode()
                request_id = fields[b"request_id"].decode(errors="replace")
                client.redis.xadd(KEYS.parts, fields)
            else:
                entry_id = client.redis.xadd(KEYS.requests, fields).decode()
                request_id = expected_id(fields, entry_id)
                if reply := named_reply(fields):
                    replies.add(reply.encode())
            # An id used twice (here, or by an earlier batch) has one result, the first publication's.
            if CUSTOM_ID.fullmatch(request_id) and request_id not in seen:
                seen.add(request_id)
                expected.append(request_id)
        expected += client.submit_many([{"id": f"{tag}good-{i}", "state": "fine", "questions": QUESTIONS}
                                        for i in range(2)])
        report = wait_and_check(client.redis, client.keys, expected, timeout=120).assert_ok()
        assert report.results[f"{tag}good-0"].ok and report.results[f"{tag}good-1"].ok
        wait_released(worker)
        own = {key for request_id in expected for key in (KEYS.result(request_id), KEYS.shares(request_id),
                                                          KEYS.body(request_id), KEYS.record(request_id))}
        shared = {KEYS.requests, KEYS.parts, KEYS.dead, KEYS.workers()}
        outside = written.keys() - {key.encode() for key in own | shared} - replies
        assert not outside, outside
        assert worker.alive and worker.get("/readyz")[0] == 200
        assert worker.metric("dq_retries_total") == 0  # bad input is answered at once, never retried
    finally:
        written.stop()
