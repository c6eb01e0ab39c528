"""How an entry ends, as plain data: a task's answers as a result or as one part's share of its request's
result, an error result, the parts of a fanned-out request merged into one result, and what a dead letter
holds. Pure and torch-free: the lifecycle builds outcomes, the publisher (the Redis side) stores them; unit
tests check the merge without a server.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import redis

from producer.wire import functions
from producer.wire.keys import Field
from producer.wire.result import Result, Timings, Usage
from producer.wire.schema import ErrorCode

from .entries import Delivery, Identity
from .tasks import Task, Timeline


@dataclass(frozen=True)
class Share:
    """A task's answers, per question name: a whole request's, or one part's share of a fanned-out request's
    (stored as JSON in the request's share hash, Keys.shares, until the last part merges them)."""

    answers: dict[str, Any]
    logits: dict[str, Any]
    probabilities: dict[str, Any]
    options: dict[str, Any]
    tokens: int
    prompts: int
    compute_ms: float
    started_ms: int
    # a prompt held only some of the request's questions (absent from older workers' shares)
    split: bool = False

    @classmethod
    def of(cls, task: Task) -> Share:
        answers = task.answers
        return cls({n: a.answer for n, a in answers.items()}, {n: a.logits for n, a in answers.items()},
                   {n: a.probabilities for n, a in answers.items()},
                   {n: a.options for n, a in answers.items()}, task.tokens, len(task.prompts),
                   round(task.compute_seconds * 1000, 3), int(task.delivery.taken * 1000),
                   any(prompt.split for prompt in task.prompts))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Share:
        return cls(**json.loads(raw))


@dataclass
class Outcome:
    """How one entry ended: a result for its request, or (for a part) the part's share of it."""

    delivery: Delivery
    identity: Identity  # the request it answers: the id, the reply stream, the context its result echoes
    result: Result | None = None  # the request's result (whole requests and errors; a last part, once merged)
    share: Share | None = None  # a part's share of a fanned-out request, until the last part merges them
    part: int = 0
    parts: int = 1
    order: list[str] = field(default_factory=list)  # question order of the request, for merging parts
    replied: bool = False  # its reply was written or refused: settling it again does not reply again
    replay: bool = False  # its id was answered before: only replied to and acknowledged, never published
    dead_letter: str | None = None  # dead-lettered, why: its entry copied to the dead letters with its result
    copied: bool = False  # its dead letter was written: settling it again does not copy it again
    # Redis refused its publication this time: settle it again later
    refused: redis.ResponseError | None = None
    timeline: Timeline | None = None  # a computed task's: when it reached each step (its time in each state)

    @property
    def request_id(self) -> str:
        return self.identity.request_id

    @property
    def reply_to(self) -> str | None:
        return self.identity.reply_to

    @property
    def publisher(self) -> str:
        """Who publishes: this delivery of this entry (its stream's key, entry id, delivery count). The key,
        not the kind of stream: each lane and shard has its own streams, whose entry ids can be the same."""
        entry = self.delivery
        return f"{entry.key} {entry.entry_id} {entry.deliveries}"

    def merge(self, shares: list[Share], model_name: str) -> None:
        """The last part: every part's share merged into the request's whole result, to publish from now
        on."""
        self.result = ok_result(self.identity, shares, self.order, self.delivery.enqueued_ms, model_name)
        self.share = None


def echo(identity: Identity) -> dict[str, Any]:
    """What a result echoes of its request, error results included: valid metadata and traceparent, its
    digest."""
    return {"metadata": identity.metadata, "traceparent": identity.traceparent, "digest": identity.digest}


def ok_result(identity: Identity, shares: list[Share], order: list[str], enqueued_ms: int,
              model_name: str) -> Result:
    """The result of a request answered in one or more shares, its questions in the request's order."""
    merged: dict[str, dict[str, Any]] = {key: {} for key in ("answers", "logits", "probabilities", "options")}
    for share in shares:
        for key, values in merged.items():
            values.update(getattr(share, key))
    ordered = {key: {n: merged[key][n] for n in order} for key in merged}
    return Result(
        id=identity.request_id, status="ok", model=model_name, **ordered, **echo(identity),
        usage=Usage(tokens=sum(s.tokens for s in shares), prompts=sum(s.prompts for s in shares),
                    parts=len(shares), split=any(s.split for s in shares) or None),
        timings=Timings(enqueued_ms=enqueued_ms, started_ms=min(s.started_ms for s in shares),
                        finished_ms=int(time.time() * 1000),
                        compute_ms=round(sum(s.compute_ms for s in shares), 3)))


def task_outcome(task: Task, model_name: str) -> Outcome:
    """A computed task: a whole request's result, or a part's share (merged by whichever part finishes
    last)."""
    order, share = list(task.request.questions), Share.of(task)
    if task.delivery.parts > 1:
        return Outcome(task.delivery, task.identity, share=share, part=task.delivery.part,
                       parts=task.delivery.parts, order=order, timeline=task.timeline)
    names = [q.name for prompt in task.prompts for q in prompt.questions]
    return Outcome(task.delivery, task.identity, result=ok_result(task.identity, [share], names,
                                                                  task.delivery.enqueued_ms, model_name),
                   timeline=task.timeline)


def answered_before(delivery: Delivery, identity: Identity, stored: Result, model_name: str) -> Outcome:
    """A request whose id already has a result: the stored result marked as a replay when it asked the same,
    else an ``id_conflict`` error (the stored result stays). A stored result without a digest answers no
    request: an error result of an older worker, or one written by something else, never answers a different
    body."""
    if stored.digest is not None and stored.digest == identity.digest:
        return Outcome(delivery, identity, result=stored.model_copy(update={"replay": True}), replay=True)
    whose = "a different request" if stored.digest is not None else "no known request (its result has no digest)"
    conflict = error_outcome(delivery, identity, ErrorCode.ID_CONFLICT,
                             f"id {identity.request_id} was answered before for {whose} (its digest "
                             f"{stored.digest}, this one's {identity.digest}); send it under a new id", model_name)
    conflict.replay = True
    return conflict


def error_outcome(delivery: Delivery, identity: Identity, code: ErrorCode, message: str,
                  model_name: str) -> Outcome:
    """An error result for the entry's request."""
    timings = Timings(enqueued_ms=delivery.enqueued_ms, started_ms=int(delivery.taken * 1000),
                      finished_ms=int(time.time() * 1000))
    return Outcome(delivery, identity, result=Result.failure(identity.request_id, code, message, timings=timings,
                                                             model=model_name, **echo(identity)))


def dead_fields(delivery: Delivery, reason: str) -> dict[Any, Any]:
    """A dead letter: the entry's fields as they were (names too: any bytes; the first MAX_DEAD_FIELDS), then
    where it was and why, which no field of its own hides."""
    own = [(name, value) for name, value in delivery.fields.items()
           if name not in {f.encode() for f in functions.OWN_DEAD_FIELDS}]
    if len(own) > functions.MAX_DEAD_FIELDS:
        reason = f"{reason} ({len(own) - functions.MAX_DEAD_FIELDS} more fields not kept)"
    return {**dict(own[: functions.MAX_DEAD_FIELDS]), Field.STREAM: delivery.stream, Field.LANE: delivery.lane,
            Field.ENTRY_ID: delivery.entry_id, Field.DELIVERIES: delivery.deliveries, Field.REASON: reason[:2000]}
