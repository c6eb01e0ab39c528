"""Results, where every entry ends: a task's answers gathered, its result published exactly once, the entry acked.

Order, for at-least-once processing with exactly one result: the Lua script makes the result durable (first
publication wins, later ones are no-ops), then the entry is acknowledged and deleted. A crash between the two
redelivers the entry; its second result is refused by the script. Parts of a fanned-out request are kept in a hash
keyed by part index (a set of finished parts, not a counter), so a part processed twice counts once.
``Publisher`` is the Redis side (torch-free: ops/redis_bench.py measures it alone); ``Results`` is the stage on the
asyncio thread, and compute's sink.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis
from redis.asyncio import RedisCluster

from producer.keys import Field, Keys
from producer.schema import ErrorCode, Result, Timings, Usage

from .entries import Delivery
from .link import Link
from .metrics import Metrics
from .tasks import Item, Task

if TYPE_CHECKING:
    from .model.readout import Answer

log = logging.getLogger("worker")
# Lua: the value of a field in a flat [name, value, ...] array (an entry's fields), or ''.
_FIELD = "local function field(f, name) for i = 1, #f, 2 do if f[i] == name then return f[i + 1] end end return '' end"
# Lua: add a reply to a reply stream, refreshing its TTL: 1, or why Redis refused (a key of another type is left
# untouched, no entry and no TTL; an ACL). Never raises: a reply must not undo what the script did before it.
_REPLY = f"""
local function reply(key, id, body, ttl)
  local kind = redis.pcall('TYPE', key)
  if kind.err then return kind.err end
  if kind.ok ~= 'stream' and kind.ok ~= 'none' then return 'WRONGTYPE the reply stream is a ' .. kind.ok end
  local added = redis.pcall('XADD', key, '*', '{Field.REPLY_ID}', id, '{Field.BODY}', body)
  if type(added) == 'table' and added.err then return added.err end
  redis.pcall('EXPIRE', key, ttl)
  return 1
end
"""
# What a publication answers once a result is stored: {'published', who published it, and (when it was not this
# call) the stored result JSON}. Who: ``Outcome.publisher``, kept in the result entry, so that a call re-run after
# its answer was lost (redis-py re-sends a pipeline on a dropped connection) still learns that it published.
_STORED = f"""
{_FIELD}
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
if first then return {{'published', field(first[2], '{Field.PUBLISHER}'), field(first[2], '{Field.BODY}')}} end
"""
# KEYS: result stream, parts hash, body key[, reply stream]. ARGV: result JSON, TTL seconds, publisher[, request id].
# With a reply stream (one Redis, not Cluster: its slot is not the request's), the reply is added in the same
# script: exactly once with the publication. Answers {'published', publisher, '', 1 or why the reply was refused}.
PUBLISH = _REPLY + _STORED + f"""
redis.call('XADD', KEYS[1], '*', '{Field.BODY}', ARGV[1], '{Field.PUBLISHER}', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('DEL', KEYS[2], KEYS[3])
local replied = 0
if KEYS[4] then replied = reply(KEYS[4], ARGV[4], ARGV[1], ARGV[2]) end
return {{'published', ARGV[3], '', replied}}
"""
# KEYS: result stream, parts hash. ARGV: part index, part count, part JSON, TTL seconds.
# As PUBLISH once the request has its result; 0: parts still missing; else every part, as HGETALL gives them.
PART = _STORED + """
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[4])
if redis.call('HLEN', KEYS[2]) < tonumber(ARGV[2]) then return 0 end
return redis.call('HGETALL', KEYS[2])
"""
# Redis Cluster: the reply on its own, after the publication (at least once). KEYS: reply stream. ARGV: request
# id, result JSON, TTL seconds.
REPLY = _REPLY + """
local answer = reply(KEYS[1], ARGV[1], ARGV[2], ARGV[3])
if answer == 1 then return 1 end
return redis.error_reply(answer)
"""
PUBLISHED = b"published"
CLUSTER_CONCURRENCY = 64  # script calls in flight at once on Redis Cluster (connections per node stay bounded)
BATCH = 512  # outcomes settled in one go at most


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

    @property
    def publisher(self) -> str:
        """Who publishes: this delivery of this entry (stream, entry id, delivery count)."""
        entry = self.delivery
        return f"{entry.stream} {entry.entry_id} {entry.deliveries}"

def share(task: Task) -> dict[str, Any]:
    """A task's answers as JSON-ready dicts (a whole result's fields, or a part's share of them)."""
    answers = task.answers
    return {
        "answers": {n: a.answer for n, a in answers.items()},
        "logits": {n: a.logits for n, a in answers.items()},
        "probabilities": {n: a.probabilities for n, a in answers.items()},
        "options": {n: a.options for n, a in answers.items()},
        "tokens": task.tokens, "prompts": len(task.chunks),
        "compute_ms": round(task.compute_seconds * 1000, 3), "started_ms": int(task.delivery.taken * 1000),
    }


def ok_result(request_id: str, shares: list[dict[str, Any]], order: list[str], enqueued_ms: int,
              model: str) -> Result:
    merged: dict[str, dict[str, Any]] = {key: {} for key in ("answers", "logits", "probabilities", "options")}
    for part in shares:
        for key in merged:
            merged[key].update(part[key])
    ordered = {key: {n: merged[key][n] for n in order} for key in merged}
    return Result(
        id=request_id, status="ok", model=model, **ordered,
        usage=Usage(tokens=sum(p["tokens"] for p in shares), prompts=sum(p["prompts"] for p in shares),
                    parts=len(shares)),
        timings=Timings(enqueued_ms=enqueued_ms, started_ms=min(p["started_ms"] for p in shares),
                        finished_ms=int(time.time() * 1000), compute_ms=round(sum(p["compute_ms"] for p in shares), 3)))


def task_outcome(task: Task, model: str) -> Outcome:
    order = list(task.request.questions)
    if task.parts > 1:
        return Outcome(task.delivery, task.request.reply_to, part=(task.part, task.parts, share(task)), order=order)
    names = [q.name for chunk in task.chunks for q in chunk.questions]
    result = ok_result(task.request_id, [share(task)], names, task.delivery.enqueued_ms, model)
    return Outcome(task.delivery, task.request.reply_to, result=result)


def error_outcome(delivery: Delivery, code: ErrorCode, message: str, model: str,
                  reply_to: str | None = None) -> Outcome:
    """An error result for the entry's request; its reply stream is the delivery's unless given."""
    timings = Timings(enqueued_ms=delivery.enqueued_ms, started_ms=int(delivery.taken * 1000),
                      finished_ms=int(time.time() * 1000))
    return Outcome(delivery, reply_to if reply_to is not None else delivery.reply_to,
                   result=Result.failure(delivery.request_id, code, message, timings=timings, model=model))


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
        self._publish = redis_client.register_script(PUBLISH)
        self._part = redis_client.register_script(PART)
        self._reply = redis_client.register_script(REPLY)
        self.inline_replies = not isinstance(redis_client, RedisCluster)  # in the publication script (see PUBLISH)

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
                calls.append((self._part, [self.keys.result(request_id), self.keys.parts(request_id)],
                              [index, count, json.dumps(part), self.ttl]))
        decided: list[tuple[Outcome, Any]] = []
        merged: list[Outcome] = []
        for outcome, reply in zip(outcomes, await self._scripts(calls)):
            if outcome.part is not None and isinstance(reply, list) and reply[:1] != [PUBLISHED]:
                indexes = sorted(range(0, len(reply), 2), key=lambda at: int(reply[at]))  # HGETALL: index, share, ...
                outcome.result = ok_result(outcome.delivery.request_id, [json.loads(reply[at + 1]) for at in indexes],
                                           outcome.order or [], outcome.delivery.enqueued_ms, self.model)
                outcome.part = None  # the last part: from now on, the request's whole result to publish
                merged.append(outcome)
            else:
                decided.append((outcome, reply))
        if merged:
            decided += zip(merged, await self._scripts([self._publication(outcome) for outcome in merged]))
        settled = []
        for outcome, reply in decided:
            if isinstance(reply, redis.ResponseError):
                outcome.refused = reply
                continue
            settled.append((outcome, *self._who(outcome, reply)))
            if isinstance(reply, list) and len(reply) > 3 and outcome.reply_to:  # replied in the publication
                outcome.replied = True
                if reply[3] != 1:
                    self.reply_refused(outcome, redis.ResponseError(_text(reply[3])))
        replies = [(outcome, result) for outcome, result, _, reply in settled
                   if reply and outcome.reply_to and not outcome.replied and not self.inline_replies]
        if replies:  # before the ack: a crash in between replies again on redelivery rather than never
            answers = await self._scripts([(self._reply, [outcome.reply_to], [
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
        keys = [self.keys.result(request_id), self.keys.parts(request_id), self.keys.body(request_id)]
        args = [outcome.result.model_dump_json(exclude_none=True), self.ttl, outcome.publisher]
        if self.inline_replies and outcome.reply_to and not outcome.replied:
            keys.append(outcome.reply_to)
            args.append(request_id)
        return self._publish, keys, args

    async def _scripts(self, calls: list[tuple[Any, list[str], list[Any]]]) -> list[Any]:
        """Script calls in one pipelined round trip; on Redis Cluster, whose pipelines refuse scripts, as concurrent
        calls, each sent to the node of its keys' one slot. A call Redis refuses answers its ResponseError; a
        connection error raises."""
        if isinstance(self.redis, RedisCluster):
            replies: list[Any] = []
            for start in range(0, len(calls), CLUSTER_CONCURRENCY):
                replies += await asyncio.gather(*(script(keys=keys, args=args) for script, keys, args
                                                  in calls[start: start + CLUSTER_CONCURRENCY]), return_exceptions=True)
        else:
            async with self.redis.pipeline(transaction=False) as pipe:
                for script, keys, args in calls:
                    await script(keys=keys, args=args, client=pipe)
                replies = await pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, BaseException) and not isinstance(reply, redis.ResponseError):
                raise reply
        return replies

    async def fan_out(self, task: Task) -> None:
        """Store the request once, add one chunk-stream entry per part (``task.fan_out``), then acknowledge the
        request entry."""
        entry, groups = task.delivery, task.fan_out
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.body(entry.request_id), entry.body, ex=self.ttl)
            for index, names in enumerate(groups):
                pipe.xadd(self.keys.chunks, {Field.REQUEST_ID: entry.request_id, Field.PART: index,
                                             Field.PARTS: len(groups), Field.QUESTIONS: json.dumps(names),
                                             Field.ENQUEUED_MS: entry.enqueued_ms})
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
        fields: dict[Any, Any] = {**delivery.fields, Field.STREAM: delivery.stream, Field.ENTRY_ID: delivery.entry_id,
                                  Field.DELIVERIES: delivery.deliveries, Field.REASON: reason[:2000]}
        for name in (Field.STREAM, Field.ENTRY_ID, Field.DELIVERIES, Field.REASON):
            fields.pop(name.encode(), None)
        await self.redis.xadd(self.keys.dead, fields)


class Results:
    """The stage: the GPU stage's sink, and the loop that publishes outcomes. Task state is the loop thread's: the
    three sink calls come from the GPU thread and only hop onto the loop."""

    def __init__(self, publisher: Publisher, link: Link, loop: asyncio.AbstractEventLoop, metrics: Metrics,
                 release: Callable[[Delivery], None], fail: Callable[[Delivery, str], None]) -> None:
        self.publisher, self.link, self.loop, self.metrics = publisher, link, loop, metrics
        self.model = publisher.model
        self.release = release  # the entry is settled: intake lets it go
        self.fail = fail  # the daemon's failure policy (retry, or dead-letter)
        self.outcomes: asyncio.Queue[Outcome] = asyncio.Queue()
        publisher.reply_refused = self.reply_refused

    # ---- compute's sink (GPU thread)

    def chunk_done(self, item: Item, answers: list[Answer], seconds: float) -> None:
        self.loop.call_soon_threadsafe(self._chunk_done, item, answers, seconds)

    def task_failed(self, task: Task, reason: str) -> None:
        self.loop.call_soon_threadsafe(self._task_failed, task, reason)

    def task_expired(self, task: Task) -> None:
        self.loop.call_soon_threadsafe(self._task_expired, task)

    # ---- loop thread

    def _chunk_done(self, item: Item, answers: list[Answer], seconds: float) -> None:
        task = item.task
        if task.cancelled:
            return
        task.answers.update({answer.name: answer for answer in answers})
        task.compute_seconds += seconds
        task.remaining -= 1
        if task.remaining == 0:
            self.settle(task_outcome(task, self.model))

    def _task_failed(self, task: Task, reason: str) -> None:
        if not task.cancelled:
            task.cancelled = True
            self.fail(task.delivery, reason)

    def _task_expired(self, task: Task) -> None:
        if task.cancelled or task.remaining == 0:
            return
        task.cancelled = True
        self.settle(error_outcome(task.delivery, ErrorCode.DEADLINE_EXCEEDED, "the deadline passed before compute",
                                  self.model, task.request.reply_to))

    def settle(self, outcome: Outcome) -> None:
        self.outcomes.put_nowait(outcome)

    async def ack_only(self, delivery: Delivery) -> None:
        await self.link.until(lambda: self.publisher.ack([delivery]), "ack")
        self.release(delivery)

    async def dead_letter(self, delivery: Delivery, reason: str, answer: bool = True) -> None:
        """Copy the entry to the dead-letter stream, then answer its request (``answer``) or only acknowledge it."""
        log.error("dead-lettering %s of %s after %d deliveries: %s", delivery.entry_id, delivery.key,
                  delivery.deliveries, reason)
        await self.link.until(lambda: self.publisher.dead_letter(delivery, reason), "dead letter")
        self.metrics.dead_letters.inc()
        if not answer:
            await self.ack_only(delivery)
            return
        self.settle(error_outcome(delivery, ErrorCode.DEAD_LETTERED,
                                  f"gave up after {delivery.deliveries} deliveries: {reason}", self.model))

    async def run(self) -> None:
        """Until cancelled: settle what is queued, up to BATCH outcomes at a time; never drop one."""
        while True:
            batch = [await self.outcomes.get()]
            while not self.outcomes.empty() and len(batch) < BATCH:
                batch.append(self.outcomes.get_nowait())
            try:
                done = await self.link.until(lambda: self.publisher.settle(batch), "publish")
            except Exception:  # noqa: BLE001 - a bug, or stopping past the drain: keep the batch, try again
                log.exception("settling %d outcomes failed; trying again in a second", len(batch))
                for outcome in batch:
                    self.loop.call_later(1.0, self.outcomes.put_nowait, outcome)
                continue
            for outcome in batch:  # Redis refused its publication (OOM, NOPERM, ...): the others went on
                if outcome.refused is not None:
                    self._again(outcome, outcome.refused)
            now = time.time()
            for outcome, result, published in done:
                self.release(outcome.delivery)
                if result is not None and published:
                    code = result.error.code.value if result.error else ""
                    self.metrics.results.labels(result.status, code).inc()
                    self.metrics.latency.observe(max(0.0, now - outcome.delivery.enqueued_ms / 1000))

    def _again(self, outcome: Outcome, error: redis.ResponseError) -> None:
        """Settle a refused outcome again later: at once after a script cache flush (routine after a restart),
        else in a second, counted, logged once per interval, and the worker unready meanwhile."""
        outcome.refused = None
        if not isinstance(error, redis.exceptions.NoScriptError):
            self.link.refused("publish", error)
        self.loop.call_later(0.01 if isinstance(error, redis.exceptions.NoScriptError) else 1.0,
                             self.outcomes.put_nowait, outcome)

    def reply_refused(self, outcome: Outcome, error: Exception) -> None:
        """A reply Redis refused (its stream is a key of another type, an ACL, memory): counted, logged once per
        interval, dropped: the result stream holds the result, and the work goes on."""
        self.link.refused("reply", error, stalls=False,
                          detail=f"reply to {(outcome.reply_to or '')[:200]} of {outcome.delivery.request_id}")
