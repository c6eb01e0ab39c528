"""Stream entries as this worker takes them: each one's fields parsed once, when taken, into a typed
``Delivery``; and the ``Identity`` of the request an entry answers.

Every field of every entry is a producer's (or anyone's who can write the stream). Each field has one parser
below, and a field no parser knows is refused; a bad field does not stop the parse: its reason is kept in
``Delivery.invalid`` and the entry's request is answered with it at once (``answerable``: a part without a
usable request id names no request, and is dead-lettered). A request entry's body is not parsed here, on the
Redis loop thread, where a large one (images) would stall every read: the planner parses it once, off that
thread, and the request's identity (id, reply stream, echoed context) comes from that parse (``identify``).
Until then a delivery names its request by a bounded look at the body's first bytes, or by its entry id.
Torch-free: the Redis side of the worker and the tools that measure it import this without the model.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from producer.wire.digest import body_digest, digest
from producer.wire.keys import ID_PATTERN, NORMAL, Field, Keys, Priority, valid_id
from producer.wire.schema import (MAX_NAME_CHARS, MAX_QUESTIONS, ErrorCode, RequestError, load_json,
                                  valid_metadata, valid_traceparent, validate)


class Stream(enum.StrEnum):
    """The work streams a worker reads (a metric label, and the ``stream`` field of dead letters)."""

    REQUESTS = "requests"  # request entries: one field, the request JSON
    PARTS = "chunks"  # the parts of fanned-out requests: request id, part, parts, questions, enqueue time


REQUESTS, PARTS = Stream.REQUESTS, Stream.PARTS
FIELDS = {
    REQUESTS: {Field.BODY},
    PARTS: {Field.REQUEST_ID, Field.PART, Field.PARTS, Field.QUESTIONS, Field.ENQUEUED_MS, Field.TRACEPARENT},
}
# Room beside a body of --max-entry-bytes: a body at the producers' own limit (MAX_BODY_BYTES, the default of
# --max-entry-bytes) was refused for its field name's four bytes.
FIELDS_BESIDE_BODY = 1024
# an enqueue time this far ahead of the worker's clock is not believed (clocks drift a little)
AHEAD_MS = 5000
NUMBER = re.compile(rb"\A[0-9]{1,15}\Z")  # non-negative, no sign, no spaces or underscores, below 2**53
# A request body's id, where the Python client writes it: first (``_leading_id``).
LEADING_ID = re.compile(rb'\A\s*\{\s*"id"\s*:\s*"([A-Za-z0-9._:\-]{1,128})"\s*[,}]')
T = TypeVar("T")


class BadField(ValueError):
    """One field of an entry that cannot be used as it is."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"field {name!r} {why}")
        self.field = name


@dataclass(frozen=True)
class Identity:
    """Who a request is and what its result carries back: the id its result is published under, its reply
    stream (one of this deployment's), and the caller's context an answer echoes (each only when valid)."""

    request_id: str
    reply_to: str | None = None
    metadata: dict[str, Any] | None = None
    traceparent: str | None = None
    digest: str | None = None  # what it asks (producer/wire/digest.py): every result of it carries this

    @property
    def log_fields(self) -> dict[str, str]:
        """What log lines about this request carry (``log.error(..., extra=identity.log_fields)``)."""
        return {"request_id": self.request_id, **({"traceparent": self.traceparent}
                                                  if self.traceparent else {})}


def identify(keys: Keys, body: Any, fallback_id: str, traceparent: str | None = None) -> Identity:
    """A request's identity from its parsed body (any value at all: these decide where even the error result
    of a bad request goes, and what it echoes): the body's valid ``id``, else ``fallback_id``; ``reply_to``
    when it is one of this deployment's reply streams; valid metadata and traceparent (``traceparent``: a
    part's own, first)."""
    if not isinstance(body, dict):
        return Identity(fallback_id, traceparent=traceparent)
    candidate, reply_to = body.get("id"), body.get("reply_to")
    return Identity(candidate if valid_id(candidate) else fallback_id,
                    reply_to if keys.is_reply_stream(reply_to) else None,
                    valid_metadata(body.get("metadata")),
                    traceparent or valid_traceparent(body.get("traceparent")))


@dataclass(frozen=True)
class Delivery:
    """One stream entry as Redis handed it to this consumer, its fields parsed."""

    stream: Stream
    key: str  # the stream's Redis key
    entry_id: str
    # as Redis gave them: the body is read from here, dead letters copy them all
    fields: Mapping[bytes, bytes]
    deliveries: int  # Redis' delivery counter, this delivery included
    taken: float  # when this worker took it (s since the epoch)
    identity: Identity  # a part's, from its fields; a request entry's before its body is parsed (module doc)
    enqueued_ms: int
    part: int = 0  # part entries: which part of the request, of how many, and the part's question names
    parts: int = 1
    questions: list[str] | None = None
    invalid: str | None = None  # why the entry cannot be processed (its first problem); None when it can
    invalid_code: ErrorCode = ErrorCode.INVALID_REQUEST  # the error result's code when it cannot
    answerable: bool = True  # False: a part naming no usable request (no result can go anywhere)
    size: int = 0  # bytes of every field name and value
    lane: Priority = NORMAL  # the lane of the stream it is in, which is its priority
    # its enqueue time was ahead of this worker's clock (a chosen entry id, or clock skew)
    ahead: bool = False

    @classmethod
    def parse(cls, stream: Stream, key: str, entry_id: str, fields: Mapping[bytes, bytes],
              deliveries: int, max_bytes: int | None = None, lane: Priority = NORMAL) -> Delivery:
        """Every field parsed here, once; a bad one leaves a usable fallback and its reason in ``invalid``. An
        entry over ``max_bytes`` and ``FIELDS_BESIDE_BODY`` (all fields counted) is refused before its body is
        parsed."""
        problems: list[str] = []
        size = sum(len(name) + len(value) for name, value in fields.items())
        too_large = max_bytes is not None and size > max_bytes + FIELDS_BESIDE_BODY
        if too_large:
            problems.append(f"the entry is {size} bytes; this worker takes a body of at most {max_bytes} and "
                            f"{FIELDS_BESIDE_BODY} bytes besides (field names, a part's fields)")
        unknown = sorted(name.decode(errors="backslashreplace") for name in fields
                         if name.decode(errors="replace") not in FIELDS[stream])
        if unknown:
            problems.append(f"field {unknown[0][:40]!r} is not a field of {stream} entries "
                            f"({', '.join(sorted(FIELDS[stream]))})")
        enqueued_ms = int(entry_id.split("-")[0])  # a Redis entry id starts with its time in ms
        part, parts, questions, answerable, traceparent, asked = 0, 1, None, True, None, None
        if stream == PARTS:
            request_id = _checked(problems, lambda: _request_id(fields), None)
            answerable = request_id is not None
            enqueued_ms = _checked(problems, lambda: _integer(fields, Field.ENQUEUED_MS), enqueued_ms)
            parts = _checked(problems, lambda: _integer(fields, Field.PARTS, 1, MAX_QUESTIONS), 1)
            part = _checked(problems, lambda: _integer(fields, Field.PART, 0, parts - 1), 0)
            questions = _checked(problems, lambda: _names(fields, Field.QUESTIONS), [])
            # only for logs: a bad one is left out, not fatal
            raw_trace = fields.get(Field.TRACEPARENT.encode())
            traceparent = valid_traceparent(raw_trace.decode(errors="replace")) if raw_trace else None
        else:
            body = fields.get(Field.BODY.encode())
            if body is None:
                problems.append(f"field {Field.BODY!r} is missing")
            request_id = _leading_id(body)
            # A body too large to read is digested now, before it is let go: its too_large result is its
            # request's.
            asked = body_digest(body) if too_large and body is not None else None
        if too_large:  # its big values let go at once (names kept): nothing reads them, held they would stay
            fields = {name: value if len(value) <= 1024 else b"" for name, value in fields.items()}
        taken = time.time()
        # An entry id is the producer's to choose (XADD with an id): one ahead of this clock would make queue
        # waits and latencies 0 for it and every entry after it. Counted (``ahead``), and the wait timed from
        # now instead.
        ahead = enqueued_ms > taken * 1000 + AHEAD_MS
        return cls(stream, key, entry_id, fields, deliveries, taken, Identity(request_id or entry_id,
                   traceparent=traceparent, digest=asked if stream == REQUESTS else None),
                   min(enqueued_ms, int(taken * 1000)), part, parts, questions,
                   problems[0] if problems else None,
                   ErrorCode.TOO_LARGE if too_large else ErrorCode.INVALID_REQUEST, answerable, size,
                   lane, ahead)

    @property
    def body(self) -> bytes | None:
        """A request entry's request JSON (part entries have none: their request's is stored apart)."""
        return self.fields.get(Field.BODY.encode())

    @property
    def request_id(self) -> str:
        return self.identity.request_id

    def again(self) -> Delivery:
        """This entry delivered once more, from memory (a retry of an entry trimmed while held)."""
        return dataclasses.replace(self, deliveries=self.deliveries + 1, taken=time.time())

    @property
    def log_fields(self) -> dict[str, str]:
        return self.identity.log_fields

    @property
    def payload_gone(self) -> bool:
        """Pending, but its fields were trimmed away: nothing to answer with."""
        return not self.fields


def _checked(problems: list[str], parse: Callable[[], T], fallback: T) -> T:
    """``parse()``; if the field is bad, ``fallback``, with the reason noted in ``problems``."""
    try:
        return parse()
    except BadField as error:
        problems.append(str(error))
        return fallback


def _raw(fields: Mapping[bytes, bytes], name: str) -> bytes:
    value = fields.get(name.encode())
    if value is None:
        raise BadField(name, "is missing")
    return value


def _integer(fields: Mapping[bytes, bytes], name: str, low: int = 0, high: int = 2 ** 53) -> int:
    raw = _raw(fields, name)
    if not NUMBER.match(raw):
        raise BadField(name, f"is not a non-negative integer: {raw[:40]!r}")
    value = int(raw)
    if not low <= value <= high:
        raise BadField(name, f"is {value}, outside {low}..{high}")
    return value


def _request_id(fields: Mapping[bytes, bytes]) -> str:
    """A part's request: a custom id, or the entry id of a request sent without one."""
    raw = _raw(fields, Field.REQUEST_ID)
    text = raw.decode(errors="replace")
    if not ID_PATTERN.match(text):
        raise BadField(Field.REQUEST_ID, f"is not a request id: {raw[:40]!r}")
    return text


def _names(fields: Mapping[bytes, bytes], name: str) -> list[str]:
    try:
        value = json.loads(_raw(fields, name).decode())
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise BadField(name, "is not JSON") from None
    if (not isinstance(value, list) or not all(isinstance(item, str) and 1 <= len(item) <= MAX_NAME_CHARS
                                               for item in value)
            or not 1 <= len(value) <= MAX_QUESTIONS or len(set(value)) < len(value)):
        raise BadField(name, f"is not a list of 1-{MAX_QUESTIONS} distinct question names")
    return value


def _leading_id(body: bytes | None) -> str | None:
    """The id of a request body, only where the Python client writes it, first: an exact match on its first
    bytes, no scan, whatever the body's size."""
    found = LEADING_ID.match(body[:200]) if body else None
    return found.group(1).decode() if found and valid_id(found.group(1).decode()) else None


@dataclass(frozen=True)
class Refusal:
    """An entry answered at once with an error result (bad input, a deadline passed): never retried."""

    identity: Identity
    code: ErrorCode
    message: str


@dataclass(frozen=True)
class Job:
    """What planning one entry needs: its request body (a part's is stored apart), which of its questions (a
    part's share), its lane, and what its delivery knows (the identity so far; why it cannot be processed, if
    so)."""

    raw: bytes | None
    questions: list[str] | None
    lane: Priority
    known: Identity
    # the id when the body names no valid one: a request entry's entry id, a part's own field
    fallback_id: str
    part: bool = False  # a part's request id is its entry's field, whatever the body says
    invalid: str | None = None
    invalid_code: ErrorCode = ErrorCode.INVALID_REQUEST

    @classmethod
    def of(cls, delivery: Delivery, stored_body: bytes | None = None) -> Job:
        part = delivery.stream == PARTS
        return cls(stored_body if part else delivery.body, delivery.questions, delivery.lane,
                   delivery.identity, delivery.request_id if part else delivery.entry_id, part,
                   delivery.invalid, delivery.invalid_code)


def identity_of(keys: Keys, job: Job) -> tuple[Identity, dict[str, Any] | None, RequestError | None]:
    """The request's identity from one parse of its body, the parsed body, and why it is not a JSON object. A
    body too large to take is not parsed: its identity is what the delivery read of it."""
    if job.raw is None or job.invalid_code == ErrorCode.TOO_LARGE:
        return job.known, None, None
    try:
        body, error = load_json(job.raw), None
    except RequestError as bad:
        body, error = None, bad
    identity = identify(keys, body, job.fallback_id, job.known.traceparent)
    if job.part:
        identity = dataclasses.replace(identity, request_id=job.known.request_id)
    return identity, body, error


def request_digest(job: Job, body: dict[str, Any] | None) -> str | None:
    """What the request asks (producer/wire/digest.py), for every result of it, error results included: its
    digest when its body validates, else its body's bytes' (a producer accepts either as its own); a body too
    large to read was digested when read (``Delivery.parse``); a part whose stored body is gone has none."""
    if job.raw is None or (job.invalid_code == ErrorCode.TOO_LARGE and not job.part):
        return job.known.digest
    if body is not None:
        try:
            return digest(validate(body))
        except RequestError:
            pass
    return body_digest(job.raw)


def identity_with_digest(keys: Keys, job: Job) -> Identity:
    """``identity_of``'s identity with its request's digest (a dead letter's result: the body parsed once
    more)."""
    identity, body, _ = identity_of(keys, job)
    return dataclasses.replace(identity, digest=request_digest(job, body))
