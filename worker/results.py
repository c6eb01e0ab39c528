"""Results: aggregate parts, publish each request's result exactly once, then acknowledge the entries.

Order, for at-least-once processing with exactly one result: the Lua script makes the result durable (first
publication wins, later ones are no-ops), then the entry is acknowledged and deleted. A crash between the two
redelivers the entry; its second result is refused by the script. Parts of a fanned-out request are kept in a hash
keyed by part index (a set of finished parts, not a counter), so a part processed twice counts once.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import RedisCluster

from producer.keys import Keys
from producer.schema import ErrorCode, Result, Timings, Usage

from .tasks import Delivery, Task

# KEYS: result stream, parts hash, body key. ARGV: result JSON, TTL seconds. 1 if published now, 0 if already.
PUBLISH = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('XADD', KEYS[1], '*', 'body', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('DEL', KEYS[2], KEYS[3])
return 1
"""
# KEYS: parts hash, result stream. ARGV: part index, part count, part JSON, TTL seconds.
# -1: the request already has its result; 0: parts still missing; else every part, as HGETALL gives them.
PART = """
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[4])
if redis.call('HLEN', KEYS[1]) < tonumber(ARGV[2]) then return 0 end
return redis.call('HGETALL', KEYS[1])
"""
CLUSTER_CONCURRENCY = 64  # script calls in flight at once on Redis Cluster (connections per node stay bounded)


@dataclass
class Outcome:
    """How one entry ended: a result for its request, or (for a part) the part's share of it."""

    delivery: Delivery
    request_id: str
    reply_to: str | None
    result: Result | None = None  # the request's result (whole requests and errors)
    part: tuple[int, int, dict[str, Any]] | None = None  # (index, count, share) of a fanned-out request
    order: list[str] | None = None  # question order of the request, for merging parts


def _now_ms() -> int:
    return int(time.time() * 1000)


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
    merged: dict[str, dict[str, Any]] = {k: {} for k in ("answers", "logits", "probabilities", "options")}
    for part in shares:
        for key in merged:
            merged[key].update(part[key])
    ordered = {key: {n: merged[key][n] for n in order} for key in merged}
    return Result(
        id=request_id, status="ok", model=model, **ordered,
        usage=Usage(tokens=sum(p["tokens"] for p in shares), prompts=sum(p["prompts"] for p in shares),
                    parts=len(shares)),
        timings=Timings(enqueued_ms=enqueued_ms, started_ms=min(p["started_ms"] for p in shares),
                        finished_ms=_now_ms(), compute_ms=round(sum(p["compute_ms"] for p in shares), 3)))


def task_outcome(task: Task, model: str) -> Outcome:
    order = list(task.request.questions)
    if task.parts > 1:
        return Outcome(task.delivery, task.request_id, task.request.reply_to,
                       part=(task.part, task.parts, share(task)), order=order)
    names = [q.name for chunk in task.chunks for q in chunk.questions]
    result = ok_result(task.request_id, [share(task)], names, task.delivery.enqueued_ms, model)
    return Outcome(task.delivery, task.request_id, task.request.reply_to, result=result)


def error_outcome(delivery: Delivery, request_id: str, code: ErrorCode, message: str, model: str,
                  reply_to: str | None = None) -> Outcome:
    timings = Timings(enqueued_ms=delivery.enqueued_ms, started_ms=int(delivery.taken * 1000),
                      finished_ms=_now_ms())
    return Outcome(delivery, request_id, reply_to,
                   result=Result.failure(request_id, code, message, timings=timings, model=model))


class Publisher:
    """Settles outcomes in batches: two or three pipelined round trips however many there are."""

    def __init__(self, redis: Any, keys: Keys, ttl_seconds: int, model: str) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl = ttl_seconds
        self.model = model
        self._publish = redis.register_script(PUBLISH)
        self._part = redis.register_script(PART)

    async def settle(self, outcomes: list[Outcome]) -> list[tuple[Outcome, Result | None, bool]]:
        """Publish and acknowledge; returns (outcome, result published for its request or None, published now).
        Idempotent: on a Redis error the caller retries the whole batch."""
        k = self.keys
        calls = []
        for o in outcomes:
            if o.part is None:
                calls.append((self._publish, [k.result(o.request_id), k.parts(o.request_id), k.body(o.request_id)],
                              [o.result.model_dump_json(exclude_none=True), self.ttl]))
            else:
                index, count, part = o.part
                calls.append((self._part, [k.parts(o.request_id), k.result(o.request_id)],
                              [index, count, json.dumps(part), self.ttl]))
        replies = await self._scripts(calls)
        final: list[tuple[Outcome, Result | None, Any]] = []
        merges: list[tuple[Outcome, Result]] = []
        for o, reply in zip(outcomes, replies):
            if o.part is None:
                final.append((o, o.result, reply))
            elif isinstance(reply, list):  # the last part: merge and publish the request's result
                shares = [json.loads(reply[i + 1]) for i in sorted(range(0, len(reply), 2), key=lambda i: int(reply[i]))]
                merges.append((o, ok_result(o.request_id, shares, o.order or [], o.delivery.enqueued_ms, self.model)))
            else:
                final.append((o, None, 0))
        if merges:
            replies = await self._scripts([
                (self._publish, [k.result(o.request_id), k.parts(o.request_id), k.body(o.request_id)],
                 [result.model_dump_json(exclude_none=True), self.ttl]) for o, result in merges])
            for (o, result), reply in zip(merges, replies):
                final.append((o, result, reply))
        async with self.redis.pipeline(transaction=False) as pipe:
            for o, result, published in final:
                # A redelivered entry may have crashed between publishing and replying: reply again.
                if result is not None and o.reply_to and (published or o.delivery.deliveries > 1):
                    pipe.xadd(o.reply_to, {"id": o.request_id, "body": result.model_dump_json(exclude_none=True)})
                    pipe.expire(o.reply_to, self.ttl)
                pipe.xack(o.delivery.key, k.group, o.delivery.entry_id)
                pipe.xdel(o.delivery.key, o.delivery.entry_id)
            await pipe.execute()
        return [(o, result, bool(published)) for o, result, published in final]

    async def _scripts(self, calls: list[tuple[Any, list[str], list[Any]]]) -> list[Any]:
        """Script calls in one pipelined round trip; on Redis Cluster, whose pipelines refuse scripts, as concurrent
        calls, each sent to the node of its keys' one slot."""
        if isinstance(self.redis, RedisCluster):
            replies: list[Any] = []
            for start in range(0, len(calls), CLUSTER_CONCURRENCY):
                replies += await asyncio.gather(*(script(keys=keys, args=args)
                                                  for script, keys, args in calls[start: start + CLUSTER_CONCURRENCY]))
            return replies
        async with self.redis.pipeline(transaction=False) as pipe:
            for script, keys, args in calls:
                await script(keys=keys, args=args, client=pipe)
            return await pipe.execute()

    async def fan_out(self, task: Task, groups: list[list[str]]) -> None:
        """Store the request once, add one chunk-stream entry per part, then acknowledge the request entry."""
        k, d = self.keys, task.delivery
        raw = d.fields[b"body"]
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(k.body(task.request_id), raw, ex=self.ttl)
            for index, names in enumerate(groups):
                pipe.xadd(k.chunks, {"request_id": task.request_id, "part": index, "parts": len(groups),
                                     "questions": json.dumps(names), "enqueued_ms": d.enqueued_ms})
            await pipe.execute()
        await self.ack([d])

    async def ack(self, deliveries: list[Delivery]) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for d in deliveries:
                pipe.xack(d.key, self.keys.group, d.entry_id)
                pipe.xdel(d.key, d.entry_id)
            await pipe.execute()

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Copy the entry to the dead-letter stream first: a crash afterwards leaves a duplicate, never a loss."""
        fields = {"stream": delivery.stream, "entry_id": delivery.entry_id, "deliveries": delivery.deliveries,
                  "reason": reason[:2000], **{k.decode(): v for k, v in delivery.fields.items()}}
        await self.redis.xadd(self.keys.dead, fields)


def part_groups(task: Task, budget: int) -> list[list[str]]:
    """Consecutive chunks grouped into parts of at most ``budget`` tokens (a longer chunk is a part alone)."""
    groups: list[list[str]] = [[]]
    used = 0
    for chunk in task.chunks:
        if groups[-1] and used + chunk.length > budget:
            groups.append([])
            used = 0
        groups[-1].extend(q.name for q in chunk.questions)
        used += chunk.length
    return groups
