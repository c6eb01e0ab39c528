"""Stream entries as this worker takes them: each one parsed once, when taken, into a typed ``Delivery``.

Every field of every entry is a producer's (or anyone's who can write the stream). Each field has one parser
below; a bad field does not stop the parse: its reason is kept in ``Delivery.invalid`` and the daemon fails the
entry with it, so a delivery always names the request it answers. Torch-free: the Redis side of the worker
(intake, results) and the tools that measure it import this without the model.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from producer.keys import ID_PATTERN, NORMAL, Field, Keys, Priority
from producer.schema import valid_metadata, valid_traceparent


class Stream(enum.StrEnum):
    """The work streams a worker reads (a metric label, and the ``stream`` field of dead letters)."""

    REQUESTS = "requests"  # request entries: one field, the request JSON
    CHUNKS = "chunks"  # the parts of fanned-out requests: request id, part, parts, questions, enqueue time


REQUESTS, CHUNKS = Stream.REQUESTS, Stream.CHUNKS
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
    part: int = 0  # chunk entries: which part of the request, of how many, and the part's question names
    parts: int = 1
    questions: list[str] | None = None
    invalid: str | None = None  # why the entry cannot be processed (its first bad field); None when it can
    # The caller's context, when valid (a bad one fails the request with invalid_request in the planner): echoed in
    # its result, even an error result, and the traceparent in this worker's log lines about the request. A part's
    # metadata is in its request's stored body; its traceparent is a field of its entry.
    metadata: dict[str, Any] | None = None
    traceparent: str | None = None
    lane: Priority = NORMAL  # the lane of the stream it is in, which is its priority

    @classmethod
    def parse(cls, keys: Keys, stream: Stream, key: str, entry_id: str, fields: Mapping[bytes, bytes],
              deliveries: int, lane: Priority = NORMAL) -> Delivery:
        """Every field parsed here, once; a bad one leaves a usable fallback and its reason in ``invalid``."""
        problems: list[str] = []
        arrival_ms = int(entry_id.split("-")[0])  # a Redis entry id starts with its time in ms
        enqueued_ms = arrival_ms
        if Field.ENQUEUED_MS.encode() in fields:  # chunk entries carry their request's
            enqueued_ms = _checked(problems, lambda: _integer(fields, Field.ENQUEUED_MS), arrival_ms)
        part, parts, questions, metadata = 0, 1, None, None
        if stream == CHUNKS:
            request_id = _checked(problems, lambda: _text(fields, Field.REQUEST_ID), entry_id)
            reply_to = None  # a part's reply stream is its request's, in the stored body
            part = _checked(problems, lambda: _integer(fields, Field.PART), 0)
            parts = _checked(problems, lambda: _integer(fields, Field.PARTS), 1)
            questions = _checked(problems, lambda: _names(fields, Field.QUESTIONS), [])
            raw_trace = fields.get(Field.TRACEPARENT.encode())  # only for logs: a bad one is left out, not fatal
            traceparent = valid_traceparent(raw_trace.decode(errors="replace")) if raw_trace else None
        else:
            request_id, reply_to, metadata, traceparent = _identity(keys, fields.get(Field.BODY.encode()), entry_id)
        return cls(stream, key, entry_id, fields, deliveries, time.time(), request_id, reply_to, enqueued_ms,
                   part, parts, questions, problems[0] if problems else None, metadata, traceparent, lane)

    @property
    def body(self) -> bytes | None:
        """A request entry's request JSON (chunk entries have none: their request's is stored apart)."""
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


def _integer(fields: Mapping[bytes, bytes], name: str) -> int:
    raw = _raw(fields, name)
    try:
        return int(raw)
    except ValueError:
        raise BadField(name, f"is not an integer: {raw[:40]!r}") from None


def _text(fields: Mapping[bytes, bytes], name: str) -> str:
    raw = _raw(fields, name)
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise BadField(name, "is not UTF-8") from None


def _names(fields: Mapping[bytes, bytes], name: str) -> list[str]:
    try:
        value = json.loads(_raw(fields, name))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise BadField(name, "is not JSON") from None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise BadField(name, "is not a list of question names")
    return value


def _identity(keys: Keys, body: bytes | None, entry_id: str
              ) -> tuple[str, str | None, dict[str, Any] | None, str | None]:
    """A request's result id (the body's valid ``id``, else the entry id), its reply stream (``reply_to`` when it
    is one of this deployment's), and its valid metadata and traceparent. Any body at all: these decide where even
    an error result goes, and what it echoes."""
    try:
        value = json.loads(body if body is not None else b"")
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        return entry_id, None, None, None
    candidate, reply_to = value.get("id"), value.get("reply_to")
    request_id = candidate if isinstance(candidate, str) and ID_PATTERN.match(candidate) else entry_id
    reply_to = reply_to if isinstance(reply_to, str) and reply_to.startswith(keys.reply_prefix) else None
    return request_id, reply_to, valid_metadata(value.get("metadata")), valid_traceparent(value.get("traceparent"))
