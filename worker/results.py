"""Results, where every entry ends: a task's answers gathered, its result published exactly once, the entry acked.

Order, for at-least-once processing with exactly one result: the publish function (producer/library.py) makes the
result durable (first publication wins, later ones are no-ops), then the entry is acknowledged and deleted. A crash
between the two redelivers the entry; its second result is refused by the function. Parts of a fanned-out request are kept in a hash
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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis
from redis.asyncio import RedisCluster

from producer import library
from producer.keys import Field, Keys
from producer.schema import ErrorCode, Request, Result, Timings, Usage

from .entries import Delivery
from .link import REDIS_ERRORS, Link
from .metrics import Metrics
from .tasks import Item, Task

if TYPE_CHECKING:
    from .model.readout import Answer

log = logging.getLogger("worker")
CLUSTER_CONCURRENCY = 64  # function calls in flight at once on Redis Cluster (connections per node stay bounded)
BATCH = 512  # outcomes settled in one go at most


@dataclass
class Outcome:
    """How one entry ended: a result for its request, or (for a part) the part's share of it."""

    delivery: Delivery  # names the request (``request_id``)
    reply_to: str | None
    result: Result | None = None  # the request's result (whole requests and errors)
    part: tuple[int, int, dict[str, Any]] | None = None  # (index, count, share) of a fanned-out request
    order: list[str] | None = None  # question order of the request, for merging parts
    echo: dict[str, Any] = field(default_factory=dict)  # the caller's context its request's result echoes


def echo(delivery: Delivery, request: Request | None = None) -> dict[str, Any]:
    """The caller's context a result echoes (metadata, traceparent): the parsed request's, else what was read of it
    when the entry was taken (so the error result of a bad request echoes what was valid in it)."""
    source: Request | Delivery = request if request is not None else delivery
    return {"metadata": source.metadata, "traceparent": source.traceparent}


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


def task_outcome(task: Task, model: str) -> Outcome:
    order, context = list(task.request.questions), echo(task.delivery, task.request)
    if task.parts > 1:
        return Outcome(task.delivery, task.request.reply_to, part=(task.part, task.parts, share(task)), order=order,
                       echo=context)
    names = [q.name for chunk in task.chunks for q in chunk.questions]
    result = ok_result(task.request_id, [share(task)], names, task.delivery.enqueued_ms, model, context)
    return Outcome(task.delivery, task.request.reply_to, result=result)


def error_outcome(delivery: Delivery, code: ErrorCode, message: str, model: str,
                  request: Request | None = None) -> Outcome:
    """An error result for the entry's request; its reply stream and echoed context are the parsed request's when
    there is one, else the delivery's."""
    timings = Timings(enqueued_ms=delivery.enqueued_ms, started_ms=int(delivery.taken * 1000),
                      finished_ms=int(time.time() * 1000))
    reply_to = request.reply_to if request is not None else delivery.reply_to
    return Outcome(delivery, reply_to, result=Result.failure(delivery.request_id, code, message, timings=timings,
                                                             model=model, **echo(delivery, request)))


class Publisher:
    """Settles outcomes in batches: two or three pipelined round trips however many there are."""

    def __init__(self, redis_client: Any, keys: Keys, ttl_seconds: int, model: str) -> None:
        self.redis = redis_client
        self.keys = keys
        self.ttl = ttl_seconds
        self.model = model
        self.library_ok = False  # the function library is on the server (readiness); checked by Results

    async def settle(self, outcomes: list[Outcome]) -> list[tuple[Outcome, Result | None, bool]]:
        """Publish and acknowledge; returns (outcome, result published for its request or None, published now).
        Idempotent: on a Redis error the caller retries the whole batch."""
        calls = []
        for outcome in outcomes:
            if outcome.part is None:
                calls.append(self._publication(outcome, outcome.result))
            else:
                index, count, part = outcome.part
                request_id = outcome.delivery.request_id
                calls.append((library.PART, [self.keys.parts(request_id), self.keys.result(request_id)],
                              [index, count, json.dumps(part), self.ttl]))
        replies = await self._functions(calls)
        final: list[tuple[Outcome, Result | None, Any]] = []
        merges: list[tuple[Outcome, Result]] = []
        for outcome, reply in zip(outcomes, replies):
            if outcome.part is None:
                final.append((outcome, outcome.result, reply))
            elif isinstance(reply, list):  # the last part: merge and publish the request's result
                indexes = sorted(range(0, len(reply), 2), key=lambda at: int(reply[at]))  # HGETALL: index, share, ...
                shares = [json.loads(reply[at + 1]) for at in indexes]
                merges.append((outcome, ok_result(outcome.delivery.request_id, shares, outcome.order or [],
                                                  outcome.delivery.enqueued_ms, self.model, outcome.echo)))
            else:
                final.append((outcome, None, 0))
        if merges:
            replies = await self._functions([self._publication(outcome, result) for outcome, result in merges])
            final += [(outcome, result, reply) for (outcome, result), reply in zip(merges, replies)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for outcome, result, published in final:
                entry = outcome.delivery
                # A redelivered entry may have crashed between publishing and replying: reply again.
                if result is not None and outcome.reply_to and (published or entry.deliveries > 1):
                    pipe.xadd(outcome.reply_to, {Field.REPLY_ID: entry.request_id,
                                                 Field.BODY: result.model_dump_json(exclude_none=True)})
                    pipe.expire(outcome.reply_to, self.ttl)
                pipe.xack(entry.key, self.keys.group, entry.entry_id)
                pipe.xdel(entry.key, entry.entry_id)
            await pipe.execute()
        return [(outcome, result, bool(published)) for outcome, result, published in final]

    def _publication(self, outcome: Outcome, result: Result) -> tuple[Any, list[str], list[Any]]:
        request_id = outcome.delivery.request_id
        return (library.PUBLISH, [self.keys.result(request_id), self.keys.parts(request_id),
                                  self.keys.body(request_id)], [result.model_dump_json(exclude_none=True), self.ttl])

    async def _functions(self, calls: list[tuple[str, list[str], list[Any]]]) -> list[Any]:
        """Function calls in one pipelined round trip; on Redis Cluster as concurrent calls, each sent to the node
        of its keys' one slot."""
        if isinstance(self.redis, RedisCluster):
            replies: list[Any] = []
            for start in range(0, len(calls), CLUSTER_CONCURRENCY):
                replies += await asyncio.gather(*(self.redis.fcall(name, len(keys), *keys, *args)
                                                  for name, keys, args in calls[start: start + CLUSTER_CONCURRENCY]))
            return replies
        async with self.redis.pipeline(transaction=False) as pipe:
            for name, keys, args in calls:
                pipe.fcall(name, len(keys), *keys, *args)
            return await pipe.execute()

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
        """Store the request once, add one entry per part (``task.fan_out``) to its lane's chunk stream (the parts
        of a high request stay high), then acknowledge the request entry."""
        entry, groups = task.delivery, task.fan_out
        trace = {Field.TRACEPARENT: task.request.traceparent} if task.request.traceparent else {}
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.body(entry.request_id), entry.body, ex=self.ttl)
            for index, names in enumerate(groups):
                pipe.xadd(self.keys.chunks_in(entry.lane), {Field.REQUEST_ID: entry.request_id, Field.PART: index,
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
        """Copy the entry to the dead-letter stream first: a crash afterwards leaves a duplicate, never a loss."""
        fields = {Field.STREAM: delivery.stream, Field.LANE: delivery.lane, Field.ENTRY_ID: delivery.entry_id,
                  Field.DELIVERIES: delivery.deliveries, Field.REASON: reason[:2000],
                  **{name.decode(): value for name, value in delivery.fields.items()}}
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
        self.publish_logged = float("-inf")
        self.library_logged = float("-inf")

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
                                  self.model, task.request))

    def settle(self, outcome: Outcome) -> None:
        self.outcomes.put_nowait(outcome)

    async def ack_only(self, delivery: Delivery) -> None:
        await self.link.until(lambda: self.publisher.ack([delivery]), "ack")
        self.release(delivery)

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        log.error("dead-lettering %s of %s after %d deliveries: %s", delivery.entry_id, delivery.key,
                  delivery.deliveries, reason, extra=delivery.log_fields)
        await self.link.until(lambda: self.publisher.dead_letter(delivery, reason), "dead letter")
        self.metrics.dead_letters.inc()
        self.settle(error_outcome(delivery, ErrorCode.DEAD_LETTERED,
                                  f"gave up after {delivery.deliveries} deliveries: {reason}", self.model))

    async def check_library(self) -> bool:
        """Whether the function library is loaded (loading it if missing or older, when this worker may); says so
        loudly while it is not: nothing can be published."""
        try:
            await self.publisher.ensure_library()
        except REDIS_ERRORS:  # Redis down: the link reports that
            return False
        except (library.LibraryUnavailable, redis.ResponseError) as error:  # e.g. NOPERM on the check itself
            if time.monotonic() - self.library_logged > 30:
                self.library_logged = time.monotonic()
                log.error("%s; unready: nothing can be published until the library is loaded", error)
            return False
        return True

    async def watch_library(self) -> None:
        """Until cancelled: look for the library every 5 s while it is missing, every 30 s while it is there (a
        server restarted empty has none: the worker turns unready within that time, not at its next result)."""
        while True:
            await asyncio.sleep(30.0 if await self.check_library() else 5.0)

    async def run(self) -> None:
        """Until cancelled: settle what is queued, up to BATCH outcomes at a time; never drop a batch."""
        while True:
            batch = [await self.outcomes.get()]
            while not self.outcomes.empty() and len(batch) < BATCH:
                batch.append(self.outcomes.get_nowait())
            try:
                done = await self.link.until(lambda: self.publisher.settle(batch), "publish")
            except Exception as error:  # noqa: BLE001 - never drop a batch: log, wait, try again
                for outcome in batch:
                    self.outcomes.put_nowait(outcome)
                if library.missing(error):
                    # The server lost its functions (restarted empty, FUNCTION FLUSH): load them if this worker
                    # may and settle the batch again at once (idempotent); else unready until an admin loads them.
                    await asyncio.sleep(0.01 if await self.check_library() else 1.0)
                    continue
                # e.g. OOM (Redis full under noeviction) or NOPERM (ACL): it lasts until an operator acts; one
                # line per 30 s, every failure counted.
                self.metrics.redis_errors.labels("publish").inc()
                if time.monotonic() - self.publish_logged > 30:
                    self.publish_logged = time.monotonic()
                    log.error("publishing %d outcomes failed (%s: %s); retrying every second", len(batch),
                              type(error).__name__, error, exc_info=not isinstance(error, redis.ResponseError))
                await asyncio.sleep(1.0)
                continue
            now = time.time()
            for outcome, result, published in done:
                self.release(outcome.delivery)
                if result is not None and published:
                    code = result.error.code.value if result.error else ""
                    self.metrics.results.labels(result.status, code).inc()
                    self.metrics.latency.labels(result.status, outcome.delivery.lane).observe(
                        max(0.0, now - outcome.delivery.enqueued_ms / 1000))
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("published %s: %s", result.id, code or result.status,
                                  extra=outcome.delivery.log_fields)
