"""Stream entries as this worker takes them: each one parsed once, when taken, into a typed ``Delivery``.

Every field of every entry is a producer's (or anyone's who can write the stream). Each field has one parser
below, and a field no parser knows is refused; a bad field does not stop the parse: its reason is kept in
``Delivery.invalid`` and the daemon answers the entry's request with it at once, so a delivery always names the
request it answers (``answerable``: a part without a usable request id names none, and is dead-lettered).
Torch-free: the Redis side of the worker (intake, results) and the tools that measure it import this without the
model.
"""

from __future__ import annotations

import enum
import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from producer.keys import ID_PATTERN, NORMAL, Field, Keys, Priority, valid_id
from producer.schema import MAX_NAME_CHARS, MAX_QUESTIONS, ErrorCode, valid_metadata, valid_traceparent


class Stream(enum.StrEnum):
    """The work streams a worker reads (a metric label, and the ``stream`` field of dead letters)."""

    REQUESTS = "requests"  # request entries: one field, the request JSON
    PARTS = "chunks"  # the parts of fanned-out requests: request id, part, parts, questions, enqueue time


REQUESTS, PARTS = Stream.REQUESTS, Stream.PARTS
FIELDS = {
    REQUESTS: {Field.BODY},
    PARTS: {Field.REQUEST_ID, Field.PART, Field.PARTS, Field.QUESTIONS, Field.ENQUEUED_MS, Field.TRACEPARENT},
}
NUMBER = re.compile(rb"\A[0-9]{1,15}\Z")  # non-negative, no sign, no spaces or underscores, below 2**53
# The request id of an entry too large to parse: only where the Python client writes it, first (exact, no scan).
LEADING_ID = re.compile(rb'\A\s*\{\s*"id"\s*:\s*"([A-Za-z0-9._:\-]{1,128})"\s*[,}]')
T = TypeVar("T")


class BadField(ValueError):
    """One field of an entry that cannot be used as it is."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"field {name!r} {why}")
        self.field = name


@dataclass(frozen=True)
class Delivery:
    """One stream entry as Redis handed it to this consumer, its fields parsed."""

    stream: Stream
    key: str  # the stream's Redis key
    entry_id: str
    fields: Mapping[bytes, bytes]  # as Redis gave them: the body is read from here, dead letters copy them all
    deliveries: int  # Redis' delivery counter, this delivery included
    taken: float  # when this worker took it (s since the epoch)
    request_id: str  # the id its result is published under
    reply_to: str | None  # a reply stream of this deployment the result is also written to
    enqueued_ms: int
    part: int = 0  # part entries: which part of the request, of how many, and the part's question names
    parts: int = 1
    questions: list[str] | None = None
    invalid: str | None = None  # why the entry cannot be processed (its first problem); None when it can
    invalid_code: ErrorCode = ErrorCode.INVALID_REQUEST  # the error result's code when it cannot
    answerable: bool = True  # False: a part naming no usable request (no result can go anywhere)
    size: int = 0  # bytes of every field name and value
    # The caller's context, when valid (a bad one fails the request with invalid_request in the planner): echoed in
    # its result, even an error result, and the traceparent in this worker's log lines about the request. A part's
    # metadata is in its request's stored body; its traceparent is a field of its entry (optional).
    metadata: dict[str, Any] | None = None
    traceparent: str | None = None
    lane: Priority = NORMAL  # the lane of the stream it is in, which is its priority

    @classmethod
    def parse(cls, keys: Keys, stream: Stream, key: str, entry_id: str, fields: Mapping[bytes, bytes],
              deliveries: int, max_bytes: int | None = None, lane: Priority = NORMAL) -> Delivery:
        """Every field parsed here, once; a bad one leaves a usable fallback and its reason in ``invalid``. An
        entry over ``max_bytes`` (all fields counted) is refused before its body is parsed."""
        problems: list[str] = []
        size = sum(len(name) + len(value) for name, value in fields.items())
        too_large = max_bytes is not None and size > max_bytes
        if too_large:
            problems.append(f"the entry is {size} bytes; this worker takes at most {max_bytes}")
        unknown = sorted(name.decode(errors="backslashreplace") for name in fields
                         if name.decode(errors="replace") not in FIELDS[stream])
        if unknown:
            problems.append(f"field {unknown[0][:40]!r} is not a field of {stream} entries "
                            f"({', '.join(sorted(FIELDS[stream]))})")
        enqueued_ms = int(entry_id.split("-")[0])  # a Redis entry id starts with its time in ms
        part, parts, questions, answerable, metadata, traceparent = 0, 1, None, True, None, None
        if stream == PARTS:
            request_id = _checked(problems, lambda: _request_id(fields), None)
            answerable = request_id is not None
            reply_to = None  # a part's reply stream is its request's, in the stored body
            enqueued_ms = _checked(problems, lambda: _integer(fields, Field.ENQUEUED_MS), enqueued_ms)
            parts = _checked(problems, lambda: _integer(fields, Field.PARTS, 1, MAX_QUESTIONS), 1)
            part = _checked(problems, lambda: _integer(fields, Field.PART, 0, parts - 1), 0)
            questions = _checked(problems, lambda: _names(fields, Field.QUESTIONS), [])
            raw_trace = fields.get(Field.TRACEPARENT.encode())  # only for logs: a bad one is left out, not fatal
            traceparent = valid_traceparent(raw_trace.decode(errors="replace")) if raw_trace else None
        elif too_large:
            request_id, reply_to = _leading_id(fields.get(Field.BODY.encode())) or entry_id, None
        else:
            body = fields.get(Field.BODY.encode())
            if body is None:
                problems.append(f"field {Field.BODY!r} is missing")
            request_id, reply_to, metadata, traceparent = _identity(keys, body, entry_id)
        return cls(stream, key, entry_id, fields, deliveries, time.time(), request_id or entry_id, reply_to,
                   enqueued_ms, part, parts, questions, problems[0] if problems else None,
                   ErrorCode.TOO_LARGE if too_large else ErrorCode.INVALID_REQUEST, answerable, size, metadata,
                   traceparent, lane)

    @property
    def body(self) -> bytes | None:
        """A request entry's request JSON (part entries have none: their request's is stored apart)."""
        return self.fields.get(Field.BODY.encode())

    @property
    def log_fields(self) -> dict[str, str]:
        """What log lines about this entry's request carry (``log.error(..., extra=delivery.log_fields)``)."""
        return {"request_id": self.request_id, **({"traceparent": self.traceparent} if self.traceparent else {})}

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
    found = LEADING_ID.match(body[:200]) if body else None
    return found.group(1).decode() if found and valid_id(found.group(1).decode()) else None


def _identity(keys: Keys, body: bytes | None, entry_id: str
              ) -> tuple[str, str | None, dict[str, Any] | None, str | None]:
    """A request's result id (the body's valid ``id``, else the entry id), its reply stream (``reply_to`` when it
    is one of this deployment's), and its valid metadata and traceparent. Any body at all: these decide where even
    an error result goes, and what it echoes."""
    try:
        value = json.loads(body.decode() if body is not None else "")  # UTF-8 only, as the planner reads it
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        return entry_id, None, None, None
    candidate, reply_to = value.get("id"), value.get("reply_to")
    return (candidate if valid_id(candidate) else entry_id, reply_to if keys.is_reply_stream(reply_to) else None,
            valid_metadata(value.get("metadata")), valid_traceparent(value.get("traceparent")))


def reply_stream(keys: Keys, body: bytes | None) -> str | None:
    """The reply stream a request body names, when it is one of this deployment's (a part's, from its stored
    body: for its error results, which may come before the body is planned)."""
    return _identity(keys, body, "")[1]
