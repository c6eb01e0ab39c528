"""Publication, the Redis side of an entry's end: an outcome's result stored exactly once (the function
library, producer/wire/library.py: ``publish_as``, ``part_as``, ``reply``), its reply, the entry acknowledged
and deleted; fan-out and dead letters (library_watch.py: whether the library is there). Torch-free:
ops/redis_bench.py measures it alone.

Order, for at-least-once processing with exactly one result: the publish function makes the result durable
(the first publication wins; later ones change nothing, and learn who made it), then the entry is
acknowledged and deleted. A crash between the two redelivers the entry; its second result is refused by the
function. Parts of a fanned-out request are kept in a hash keyed by part index (a set of finished parts, not
a counter), so a part processed twice counts once; the last one merges them (outcomes.py). A reply is added
by the publish function itself on one Redis (exactly once with the publication); on Redis Cluster, where a
reply stream has another slot, right after it (at least once).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.asyncio import RedisCluster

from producer.plumbing import durable
from producer.plumbing.cluster_wait import Confirmed
from producer.plumbing.commands import Command, Pipeline, apipelined, asend, command, fcall, hset
from producer.plumbing.connection import WAIT_MS
from producer.plumbing.durable import Durable
from producer.wire import library
from producer.wire.errors import NotDurable
from producer.wire.keys import Field, Keys, Record, RecordState, text
from producer.wire.result import Result, Unreadable, read_stored
from producer.wire.schema import ErrorCode

from ..entries import REQUESTS, Delivery
from ..outcomes import Outcome, Share, answered_before, dead_fields
from ..tasks import Task
from .library_watch import LibraryWatch
from .redis_calls import refusal

PUBLISHED = b"published"
# Function calls in flight at once on Redis Cluster (connections per node stay bounded).
CLUSTER_CONCURRENCY = 64


@dataclass
class Settlement:
    """What one settle call did: each outcome settled, with its request's result (None: a part stored, its
    request waiting for others) and whether this delivery published it; and the replies Redis refused (a key
    of another type, an ACL, memory), for the caller to count: never retried, never in the way."""

    settled: list[tuple[Outcome, Result | None, bool]] = field(default_factory=list)
    replies_refused: list[tuple[Outcome, redis.ResponseError]] = field(default_factory=list)
    # answered as a reused id: another entry published first
    reused: list[Outcome] = field(default_factory=list)
    # the result stored under their ids cannot be read (no worker wrote it): dead-lettered, acknowledged, why
    unreadable: list[tuple[Outcome, Unreadable]] = field(default_factory=list)
    # records not updated (an old ACL)
    records_refused: list[redis.ResponseError] = field(default_factory=list)


class Publisher:
    """Settles outcomes in batches: a few pipelined round trips however many there are."""

    def __init__(self, redis_client: Any, keys: Keys, ttl_seconds: int, model_name: str,
                 reply_maxlen: int = 10000, dead_maxlen: int = 100000, wait_replicas: int = 0, once: Any = None,
                 record_ttl_s: int | None = None) -> None:
        self.redis = redis_client
        self.once = once  # durable mode on Redis Cluster: a client that never retries a call (durable.arun)
        self.keys, self.ttl = keys, ttl_seconds
        # an answered request's record (Settings.record_ttl: never past its result); None: its result's
        self.record_ttl = ttl_seconds if record_ttl_s is None else record_ttl_s
        self.model_name = model_name  # what results say answered them
        self.reply_maxlen, self.dead_maxlen = reply_maxlen, dead_maxlen  # approximate caps: memory bounded
        # replies made in the publish call (library.PUBLISH_AS)
        self.inline_replies = not isinstance(redis_client, RedisCluster)
        self.wait_replicas = wait_replicas  # durable mode: publications and acks WAIT for this many replicas
        self.library = LibraryWatch(redis_client)  # the function library is on the server (readiness)

    async def settle(self, outcomes: list[Outcome]) -> Settlement:
        """Publish, reply, acknowledge. An outcome whose publication Redis refused is left out, with the
        error in ``refused`` (settle it again later). Idempotent: on a connection error the caller settles
        the batch again."""
        done = Settlement()
        replays = [outcome for outcome in outcomes if outcome.replay]  # answered before: reply and ack only
        outcomes = [outcome for outcome in outcomes if not outcome.replay]
        calls = []
        for outcome in outcomes:
            outcome.refused = None
            if outcome.share is None:
                calls.append(self._publication(outcome))
            else:
                request_id = outcome.request_id
                keys = [self.keys.result(request_id), self.keys.shares(request_id), self.keys.body(request_id)]
                calls.append(fcall(library.PART_AS, keys,
                                   [outcome.part, outcome.parts, outcome.share.to_json(), self.ttl]))
        decided: list[tuple[Outcome, Any]] = []
        merged: list[Outcome] = []
        for outcome, reply in zip(outcomes, await self._functions(calls)):
            if outcome.share is not None and isinstance(reply, list) and reply[:1] != [PUBLISHED]:
                # the last part: the hash's fields (HGETALL: index, share, ...) merged
                indexes = sorted(range(0, len(reply), 2), key=lambda at: int(reply[at]))
                outcome.merge([Share.from_json(reply[at + 1]) for at in indexes], self.model_name)
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
            outcome.copied = outcome.copied or bool(outcome.dead_letter and self.inline_replies)
            try:
                who = self._who(outcome, reply)
            except Unreadable as error:
                done.unreadable.append((outcome, error))
                continue
            if self._lost_race(outcome, reply, *who):
                # Another request under this id published first (both were queued before either was
                # answered): this one is answered as a reused id is at planning, its own reply a replay or an
                # id_conflict.
                answer = answered_before(outcome.delivery, outcome.identity, who[0], self.model_name)
                outcome.result, outcome.replay = answer.result, True
                done.reused.append(outcome)
                who = (answer.result, False, True)
            settled.append((outcome, *who))
            if self.inline_replies and isinstance(reply, list) and len(reply) > 3 and outcome.reply_to:
                outcome.replied = True  # in the publish call
                if reply[3] != 1:
                    done.replies_refused.append((outcome, redis.ResponseError(text(reply[3]))))
        settled += [(outcome, outcome.result, False, True) for outcome in replays]
        # Replies not made by the publish call: on Redis Cluster, and for replays (nothing was published).
        replies = [(outcome, result) for outcome, result, _, reply in settled if reply and outcome.reply_to
                   and not outcome.replied and (outcome.replay or not self.inline_replies)]
        if replies:  # before the ack: a crash in between replies again on redelivery rather than never
            answers = await self._functions([fcall(library.REPLY, [outcome.reply_to], [
                outcome.request_id, result.model_dump_json(exclude_none=True), self.ttl, self.reply_maxlen])
                for outcome, result in replies])
            for (outcome, _), answer in zip(replies, answers):
                outcome.replied = True
                if isinstance(answer, redis.ResponseError):
                    done.replies_refused.append((outcome, answer))
        # Dead letters the publication did not copy (Redis Cluster: after their result, so that a requeue
        # never finds one whose result is still to come), and entries whose id holds an unreadable result:
        # before the ack.
        for outcome in [outcome for outcome, *_ in settled if outcome.dead_letter and not outcome.copied]:
            await self.dead_letter(outcome.delivery, outcome.dead_letter)
            outcome.copied = True
        for outcome, error in done.unreadable:
            if not outcome.copied:
                await self.dead_letter(outcome.delivery, f"{error}: no result can be published under this id")
                outcome.copied = True
        done.records_refused = await self.ack(
            [outcome.delivery for outcome, *_ in settled] + [o.delivery for o, _ in done.unreadable],
            durable=True,
            answered=[(outcome, result) for outcome, result, *_ in settled
                      if result is not None and not _conflict(result)])
        done.settled = [(outcome, result, mine) for outcome, result, mine, _ in settled]
        return done

    def _who(self, outcome: Outcome, reply: Any) -> tuple[Result | None, bool, bool]:
        """From a script's answer: the request's result, whether this delivery published it, whether to
        reply."""
        if not isinstance(reply, list):  # 0: a part stored, the request still waits for others
            return None, False, False
        publisher, body = reply[1].decode(errors="replace"), reply[2] if len(reply) > 2 else b""
        # now (no body sent back), or this very call before (its answer lost)
        if publisher == outcome.publisher:
            return read_stored(body, outcome.request_id) if body else outcome.result, True, True
        # someone else's: Unreadable unless a result of its id
        stored = read_stored(body or None, outcome.request_id)
        deliveries = (publisher.split(" ") + ["", "", ""])[2]
        earlier = self._same_entry(outcome, publisher) and deliveries.isdigit() \
            and int(deliveries) < outcome.delivery.deliveries
        # An earlier delivery of this entry published and may have died before replying: reply again (a reply
        # is at least once). A publication by anyone else is theirs to reply to.
        return stored, False, earlier

    @staticmethod
    def _same_entry(outcome: Outcome, publisher: str) -> bool:
        """``publisher`` (Outcome.publisher) names this outcome's entry. Workers before the stream's key was
        in it named the kind of stream (requests, chunks): read too, during a rolling upgrade."""
        stream, entry_id = (publisher.split(" ") + ["", ""])[:2]
        return (entry_id == outcome.delivery.entry_id
                and stream in (outcome.delivery.key, outcome.delivery.stream))

    def _lost_race(self, outcome: Outcome, reply: Any, stored: Result | None, mine: bool, again: bool
                   ) -> bool:
        """The result stored under this outcome's request id is another request's. A request entry tells by
        who published it (another entry: a request under the same id); a part of a fanned-out request by its
        digest (its own request is published by whichever part completes it), so a part never takes a twin of
        its own request for another, and every part that finds another's result says so (a reply at least
        once)."""
        if stored is None or mine or again:
            return False
        if outcome.delivery.stream == REQUESTS:
            return not self._same_entry(outcome, reply[1].decode())
        if outcome.identity.digest is None:  # a part that does not know its request's digest cannot tell
            return False
        return stored.digest != outcome.identity.digest  # a stored result without one answers no request

    def _publication(self, outcome: Outcome) -> Command:
        request_id = outcome.request_id
        assert outcome.result is not None
        keys = [self.keys.result(request_id), self.keys.shares(request_id), self.keys.body(request_id)]
        args = [outcome.result.model_dump_json(exclude_none=True), self.ttl, outcome.publisher]
        reply = self.inline_replies and outcome.reply_to and not outcome.replied
        if outcome.dead_letter and not outcome.copied and self.inline_replies:  # the dead letter, its result
            dead = dead_fields(outcome.delivery, outcome.dead_letter)
            keys += [self.keys.dead, *([outcome.reply_to] if reply else [])]
            return fcall(library.DEAD_LETTER, keys, [*args, request_id, self.reply_maxlen, self.dead_maxlen,
                                                     *(value for pair in dead.items() for value in pair)])
        if reply:
            keys.append(outcome.reply_to)
            args += [request_id, self.reply_maxlen]
        return fcall(library.PUBLISH_AS, keys, args)

    async def _functions(self, calls: list[Command]) -> list[Any]:
        """Function calls in one pipelined round trip; on Redis Cluster as concurrent calls, each sent to the
        node of its keys' one slot. Durable mode: through the one executor (producer/plumbing/durable.py), a
        WAIT after them, one pipeline and WAIT per primary on Redis Cluster. A call Redis refuses answers its
        ResponseError; a connection error raises."""
        replies: list[Any] = []
        if self.wait_replicas:
            replies = self._confirmed(await self._durably(calls), "publications", len(calls))
        elif isinstance(self.redis, RedisCluster):
            for start in range(0, len(calls), CLUSTER_CONCURRENCY):
                batch = calls[start: start + CLUSTER_CONCURRENCY]
                replies += await asyncio.gather(*(asend(self.redis, call) for call in batch),
                                                return_exceptions=True)
        else:
            replies = await apipelined(self.redis, Pipeline(calls, raising=False))
        for reply in replies:  # a slot moving (TRYAGAIN, ASK) is trouble, not a refusal: the batch goes again
            if isinstance(reply, BaseException) and not refusal(reply):
                raise reply
        return replies

    async def fan_out(self, task: Task) -> None:
        """Store the request once, add one entry per part (``task.fan_out``) to its lane's part stream (the
        parts of a high request stay high), then acknowledge the request entry."""
        entry, groups, request_id = task.delivery, task.fan_out, task.request_id
        trace = {Field.TRACEPARENT: task.request.traceparent} if task.request.traceparent else {}
        # The body first, on its own: on Redis Cluster it lives on another primary than the part stream, and one
        # pipeline sends to each primary at once, so a part could be read before its body was stored (that part
        # then answered the request with an error that carries no digest).
        await self.redis.set(self.keys.body(request_id), entry.body, ex=self.ttl)
        async with self.redis.pipeline(transaction=False) as pipe:
            for index, names in enumerate(groups):
                pipe.xadd(self.keys.parts_in(entry.lane), {Field.REQUEST_ID: request_id, Field.PART: index,
                                             Field.PARTS: len(groups), Field.QUESTIONS: json.dumps(names),
                                             Field.ENQUEUED_MS: entry.enqueued_ms, **trace})
            await pipe.execute()
        await self.ack([entry])

    async def ack(self, deliveries: list[Delivery], durable: bool = False,
                  answered: list[tuple[Outcome, Result]] | None = None) -> list[redis.ResponseError]:
        """Acknowledge and delete; ``durable`` (a settlement's acks), with a WAIT in durable mode.
        ``answered``: their records say how each request was answered, kept no longer than its result;
        refusals of those are returned."""
        ids: dict[str, list[str]] = {}  # per stream, in the order taken: one XACK and one XDEL each
        for entry in deliveries:
            ids.setdefault(entry.key, []).append(entry.entry_id)
        acks = [each for key, entry_ids in ids.items()
                for each in (command("XACK", key, self.keys.group, *entry_ids), command("XDEL", key, *entry_ids))]
        records = []
        for outcome, result in answered or []:
            record, code = self.keys.record(outcome.request_id), result.error.code if result.error else ""
            records += [hset(record, {Record.STATE: RecordState.ANSWERED, Record.STATUS: result.status,
                                      Record.CODE: getattr(code, "value", code),
                                      Record.AT: int(time.time() * 1000)}),
                        command("EXPIRE", record, self.record_ttl)]
        durably = bool(durable and self.wait_replicas and deliveries)
        if durably and isinstance(self.redis, RedisCluster):
            # Acknowledged and confirmed per primary: the records follow on their own (a status, not the
            # result).
            for reply in self._confirmed(await self._durably(acks), "acknowledgements", len(deliveries)):
                if isinstance(reply, BaseException):
                    raise reply
            acks, durably = [], False
        if durably:  # on one Redis the records go with the acks, before the WAIT
            sent = await self._durably(acks + records)
            replies = sent.replies
        else:
            replies = await apipelined(self.redis, Pipeline(acks + records, raising=False))
        acked, noted = replies[: len(acks)], replies[len(acks):]
        for reply in acked + [reply for reply in noted if not refusal(reply)]:
            if isinstance(reply, BaseException):
                raise reply
        if durably:
            self._confirmed(sent, "acknowledgements", len(deliveries))
        return [reply for reply in noted if refusal(reply)]

    async def _durably(self, calls: list[Command]) -> Confirmed:
        """Durable mode: ``calls`` through the one executor; on Redis Cluster once (a doubt raises: the
        settlement is made again)."""
        return await durable.arun(self.redis, Durable(calls, self.wait_replicas), self.once, attempts=1)

    def _confirmed(self, sent: Confirmed, what: str, count: int) -> list[Any]:
        """The replies, unless fewer replicas than asked confirmed a call that went through: then NotDurable
        (a refusal: RedisCalls counts it, and the whole settlement is made again, idempotent; the executor
        has asked the sentinels again already, for a replaced primary)."""
        if (fewest := sent.fewest()) is not None and fewest < self.wait_replicas:
            raise NotDurable(f"{count} {what}: {fewest} of {self.wait_replicas} replicas confirmed within "
                             f"{WAIT_MS} ms", [], fewest, self.wait_replicas)
        return sent.replies

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Copy the entry to the dead-letter stream, before it is acknowledged: a crash in between leaves a
        duplicate, never a loss. (A dead letter with a result is copied by its publication:
        ``_publication``.)"""
        await self.redis.xadd(self.keys.dead, dead_fields(delivery, reason), maxlen=self.dead_maxlen,
                              approximate=True)


def _conflict(result: Result) -> bool:
    """An id_conflict answers a request its id's stored result is not for: the record keeps what the id
    has."""
    return result.error is not None and result.error.code == ErrorCode.ID_CONFLICT
