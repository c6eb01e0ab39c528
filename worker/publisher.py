"""Publication, the Redis side of results: an outcome's result stored exactly once (the function library,
producer/library.py: ``publish_as``, ``part_as``, ``reply``), its reply,
the entry acknowledged and deleted; fan-out and dead letters. Torch-free: ops/redis_bench.py measures it alone.

Order, for at-least-once processing with exactly one result: the publish function makes the result durable (the
first publication wins; later ones change nothing, and learn who made it), then the entry is acknowledged and
deleted. A crash between the two redelivers the entry; its second result is refused by the function. Parts of a
fanned-out request are kept in a hash keyed by part index (a set of finished parts, not a counter), so a part
processed twice counts once. A reply is added by the publish function itself on one Redis (exactly once with the
publication); on Redis Cluster, where a reply stream has another slot, right after it (at least once).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.asyncio import RedisCluster

from producer import library
from producer.keys import Field, Keys
from producer.schema import Result, Timings, Usage

from .entries import Delivery
from .tasks import Task

log = logging.getLogger("worker")
PUBLISHED = b"published"
CLUSTER_CONCURRENCY = 64  # function calls in flight at once on Redis Cluster (connections per node stay bounded)


@dataclass
class Outcome:
    """How one entry ended: a result for its request, or (for a part) the part's share of it."""

    delivery: Delivery  # names the request (``request_id``)
    reply_to: str | None
    result: Result | None = None  # the request's result (whole requests and errors; a last part, once merged)
    part: tuple[int, int, dict[str, Any]] | None = None  # (index, count, share) of a fanned-out request
    order: list[str] | None = None  # question order of the request, for merging parts
    replied: bool = False  # its reply was written or refused: settling it again does not reply again
    refused: redis.ResponseError | None = None  # Redis refused its publication this time: settle it again later
    echo: dict[str, Any] = field(default_factory=dict)  # the caller's context its request's result echoes

    @property
    def publisher(self) -> str:
        """Who publishes: this delivery of this entry (stream, entry id, delivery count)."""
        entry = self.delivery
        return f"{entry.stream} {entry.entry_id} {entry.deliveries}"

def ok_result(request_id: str, shares: list[dict[str, Any]], order: list[str], enqueued_ms: int,
              model: str, context: dict[str, Any] | None = None) -> Result:
    merged: dict[str, dict[str, Any]] = {key: {} for key in ("answers", "logits", "probabilities", "options")}
    for part in shares:
        for key in merged:
            merged[key].update(part[key])
    ordered = {key: {n: merged[key][n] for n in order} for key in merged}
    return Result(
        id=request_id, status="ok", model=model, **ordered, **(context or {}),
        usage=Usage(tokens=sum(p["tokens"] for p in shares), prompts=sum(p["prompts"] for p in shares),
                    parts=len(shares)),
        timings=Timings(enqueued_ms=enqueued_ms, started_ms=min(p["started_ms"] for p in shares),
                        finished_ms=int(time.time() * 1000), compute_ms=round(sum(p["compute_ms"] for p in shares), 3)))


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class Publisher:
    """Settles outcomes in batches: a few pipelined round trips however many there are."""

    def __init__(self, redis_client: Any, keys: Keys, ttl_seconds: int, model: str,
                 reply_refused: Callable[[Outcome, Exception], None] | None = None) -> None:
        self.redis = redis_client
        self.keys = keys
        self.ttl = ttl_seconds
        self.model = model
        self.reply_refused = reply_refused or (lambda outcome, error: None)  # counted and logged by the caller
        self.inline_replies = not isinstance(redis_client, RedisCluster)  # in the publish call (library.PUBLISH_AS)
        self.library_ok = False  # the function library is on the server (readiness); checked by Results

    async def settle(self, outcomes: list[Outcome]) -> list[tuple[Outcome, Result | None, bool]]:
        """Publish, reply, acknowledge; returns (outcome, its request's result or None, published by this
        delivery) for each outcome settled. An outcome whose publication Redis refused is left out, with the error
        in ``refused`` (settle it again later). Idempotent: on a connection error the caller settles the batch
        again. A reply Redis refuses (a key of another type, an ACL) is counted, never retried, never in the way."""
        calls = []
        for outcome in outcomes:
            outcome.refused = None
            if outcome.part is None:
                calls.append(self._publication(outcome))
            else:
                index, count, part = outcome.part
                request_id = outcome.delivery.request_id
                calls.append((library.PART_AS, [self.keys.result(request_id), self.keys.shares(request_id),
                                                self.keys.body(request_id)], [index, count, json.dumps(part), self.ttl]))
        decided: list[tuple[Outcome, Any]] = []
        merged: list[Outcome] = []
        for outcome, reply in zip(outcomes, await self._functions(calls)):
            if outcome.part is not None and isinstance(reply, list) and reply[:1] != [PUBLISHED]:
                indexes = sorted(range(0, len(reply), 2), key=lambda at: int(reply[at]))  # HGETALL: index, share, ...
                outcome.result = ok_result(outcome.delivery.request_id, [json.loads(reply[at + 1]) for at in indexes],
                                           outcome.order or [], outcome.delivery.enqueued_ms, self.model, outcome.echo)
                outcome.part = None  # the last part: from now on, the request's whole result to publish
                merged.append(outcome)
            else:
                decided.append((outcome, reply))
        if merged:
            decided += zip(merged, await self._functions([self._publication(outcome) for outcome in merged]))
        settled = []
        for outcome, reply in decided:
            if isinstance(reply, redis.ResponseError):
                outcome.refused = reply
                continue
            settled.append((outcome, *self._who(outcome, reply)))
            if self.inline_replies and isinstance(reply, list) and len(reply) > 3 and outcome.reply_to:  # replied in it
                outcome.replied = True
                if reply[3] != 1:
                    self.reply_refused(outcome, redis.ResponseError(_text(reply[3])))
        replies = [(outcome, result) for outcome, result, _, reply in settled
                   if reply and outcome.reply_to and not outcome.replied and not self.inline_replies]
        if replies:  # before the ack: a crash in between replies again on redelivery rather than never
            answers = await self._functions([(library.REPLY, [outcome.reply_to], [
                outcome.delivery.request_id, result.model_dump_json(exclude_none=True), self.ttl])
                for outcome, result in replies])
            for (outcome, _), answer in zip(replies, answers):
                outcome.replied = True
                if isinstance(answer, redis.ResponseError):
                    self.reply_refused(outcome, answer)
        await self.ack([outcome.delivery for outcome, *_ in settled])
        return [(outcome, result, mine) for outcome, result, mine, _ in settled]

    def _who(self, outcome: Outcome, reply: Any) -> tuple[Result | None, bool, bool]:
        """From a script's answer: the request's result, whether this delivery published it, whether to reply."""
        if not isinstance(reply, list):  # 0: a part stored, the request still waits for others
            return None, False, False
        publisher = reply[1].decode()
        stored = Result.model_validate_json(reply[2]) if len(reply) > 2 and reply[2] else outcome.result
        if publisher == outcome.publisher:  # now, or this very call before (its answer lost in transit)
            return stored, True, True
        stream, entry_id, deliveries = (publisher.split(" ") + ["", "", ""])[:3]
        earlier = (stream, entry_id) == (outcome.delivery.stream, outcome.delivery.entry_id) and deliveries.isdigit() \
            and int(deliveries) < outcome.delivery.deliveries
        # An earlier delivery of this entry published and may have died before replying: reply again (a reply is
        # at least once). A publication by anyone else is theirs to reply to.
        return stored, False, earlier

    def _publication(self, outcome: Outcome) -> tuple[Any, list[str], list[Any]]:
        request_id = outcome.delivery.request_id
        assert outcome.result is not None
        keys = [self.keys.result(request_id), self.keys.shares(request_id), self.keys.body(request_id)]
        args = [outcome.result.model_dump_json(exclude_none=True), self.ttl, outcome.publisher]
        if self.inline_replies and outcome.reply_to and not outcome.replied:
            keys.append(outcome.reply_to)
            args.append(request_id)
        return library.PUBLISH_AS, keys, args

    async def _functions(self, calls: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
        """Function calls in one pipelined round trip; on Redis Cluster as concurrent calls, each sent to the node
        of its keys' one slot. A call Redis refuses answers its ResponseError; a connection error raises."""
        if isinstance(self.redis, RedisCluster):
            replies: list[Any] = []
            for start in range(0, len(calls), CLUSTER_CONCURRENCY):
                replies += await asyncio.gather(*(self.redis.fcall(name, len(keys), *keys, *args) for name, keys, args
                                                  in calls[start: start + CLUSTER_CONCURRENCY]), return_exceptions=True)
        else:
            async with self.redis.pipeline(transaction=False) as pipe:
                for name, keys, args in calls:
                    pipe.fcall(name, len(keys), *keys, *args)
                replies = await pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, BaseException) and not isinstance(reply, redis.ResponseError):
                raise reply
        return replies

    async def ensure_library(self) -> None:
        """Load the function library if the server lacks it or has an older revision (when this worker's user may:
        ``library.LibraryUnavailable`` if not); ``library_ok`` says whether it is there."""
        try:
            loaded = await library.aensure(self.redis)
        except (library.LibraryUnavailable, redis.ResponseError):  # or NOPERM on the check itself
            self.library_ok = False
            raise
        if loaded.action != "present":
            log.info("function library %s revision %d %s", library.LIBRARY, loaded.revision, loaded.action)
        self.library_ok = True

    async def fan_out(self, task: Task) -> None:
        """Store the request once, add one entry per part (``task.fan_out``) to its lane's part stream (the parts
        of a high request stay high), then acknowledge the request entry."""
        entry, groups = task.delivery, task.fan_out
        trace = {Field.TRACEPARENT: task.request.traceparent} if task.request.traceparent else {}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.body(entry.request_id), entry.body, ex=self.ttl)
            for index, names in enumerate(groups):
                pipe.xadd(self.keys.parts_in(entry.lane), {Field.REQUEST_ID: entry.request_id, Field.PART: index,
                                             Field.PARTS: len(groups), Field.QUESTIONS: json.dumps(names),
                                             Field.ENQUEUED_MS: entry.enqueued_ms, **trace})
            await pipe.execute()
        await self.ack([entry])

    async def ack(self, deliveries: list[Delivery]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry in deliveries:
                pipe.xack(entry.key, self.keys.group, entry.entry_id)
                pipe.xdel(entry.key, entry.entry_id)
            await pipe.execute()

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Copy the entry to the dead-letter stream first: a crash afterwards leaves a duplicate, never a loss. Its
        fields as they were (names too: any bytes), then where it was and why, which no field of its own hides."""
        fields: dict[Any, Any] = {**delivery.fields, Field.STREAM: delivery.stream, Field.LANE: delivery.lane,
                                  Field.ENTRY_ID: delivery.entry_id, Field.DELIVERIES: delivery.deliveries,
                                  Field.REASON: reason[:2000]}
        for name in (Field.STREAM, Field.LANE, Field.ENTRY_ID, Field.DELIVERIES, Field.REASON):
            fields.pop(name.encode(), None)
        await self.redis.xadd(self.keys.dead, fields)
