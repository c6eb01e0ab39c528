"""An entry's life in one room, on the Redis loop thread, which owns every held entry and task; the GPU thread only
hands compute's results over (``prompt_done``, ``task_failed``, ``task_expired``), onto the loop.

    take     held once, however it arrived (read, recovered, reclaimed, retried), then routed: payload trimmed away
             -> acknowledged, counted lost; a part naming no request -> dead-lettered, unanswered; delivered over
             --max-deliveries times -> dead-lettered with an error result; else planned
    plan     the planner parses the body once (threads or processes): a Task, or a Refusal answered at once; an id
             answered before is a replay or a conflict, not computed again
    queue    a task's prompts to the packer; a task over --fanout-tokens is fanned out as parts instead
    failed   a failed pack: the same task again under a new delivery (its counter up), or dead-lettered
    settle   each outcome published once, replied to, acknowledged; then the entry is let go (``release``)

Held entries keep the order they were taken in; each lane has room for ``--max-inflight`` of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import redis

from producer.wire import library
from producer.wire.keys import LANES, Keys, Priority
from producer.wire.schema import ErrorCode

from ..config import Settings
from ..entries import PARTS, REQUESTS, Delivery, Identity, Job, Refusal, identity_of
from ..metrics import Metrics
from ..outcomes import Outcome, answered_before, error_outcome, task_outcome
from ..tasks import Item, Task
from .consumer import Consumer
from .publisher import Publisher
from .redis_calls import Link

if TYPE_CHECKING:  # torch-free at run time: the Redis side loads without the model's libraries
    from ..model.readout import Answer
    from ..gpu.packer import Packer
    from ..plan.planner import Planner

log = logging.getLogger("worker")
BATCH = 512  # outcomes settled in one go at most
# Remembered lately: payload-less entries (each counted once), entries let go (a read begun before takes none again)
LOST_REMEMBERED = SETTLED_REMEMBERED = 10_000


class Lifecycle:
    def __init__(self, keys: Keys, settings: Settings, metrics: Metrics, link: Link, consumer: Consumer,
                 planner: Planner, packer: Packer, publisher: Publisher, loop: asyncio.AbstractEventLoop) -> None:
        self.keys, self.settings, self.metrics, self.link, self.loop = keys, settings, metrics, link, loop
        self.consumer, self.planner, self.packer, self.publisher = consumer, planner, packer, publisher
        self.model = publisher.model
        self.held: dict[tuple[str, str], Delivery] = {}  # by (stream key, entry id): ids are unique per stream only
        self.held_in = dict.fromkeys(LANES, 0)
        self.room = {lane: asyncio.Event() for lane in LANES}  # set when an entry of the lane is let go
        self.lost: dict[tuple[str, str], None] = {}  # counted as lost, recent ones
        self.settled: dict[tuple[str, str], float] = {}  # -> when let go (monotonic), recent ones
        self.settled_at: float | None = None  # when an entry was last let go (health; burst runs)
        self.outcomes: asyncio.Queue[Outcome] = asyncio.Queue()

    # ---- the held table

    def take(self, delivery: Delivery, how: str, since: float | None = None) -> None:
        """Hold an entry and route it, once however it arrived; not one let go ``since`` the call that found it."""
        if self._hold(delivery, how, since):
            self._route(delivery)

    def _hold(self, delivery: Delivery, how: str, since: float | None) -> bool:
        if self.known((delivery.key, delivery.entry_id), since):
            return False
        self.held[delivery.key, delivery.entry_id] = delivery
        self.held_in[delivery.lane] += 1
        metrics = self.metrics
        metrics.inflight.set(len(self.held))
        metrics.entries.labels(delivery.stream, how).inc()
        metrics.entries_ahead.labels(delivery.stream).inc(int(delivery.ahead))
        if delivery.deliveries > 1:
            metrics.redeliveries.labels(delivery.stream).inc()
        else:
            metrics.queue_wait.labels(delivery.lane).observe(max(0.0, delivery.taken - delivery.enqueued_ms / 1000))
        return True

    def known(self, entry: tuple[str, str], since: float | None) -> bool:  # held now, or let go since ``since``
        return entry in self.held or (since is not None and self.settled.get(entry, float("-inf")) >= since)

    def release(self, delivery: Delivery) -> None:
        entry = (delivery.key, delivery.entry_id)
        if self.held.pop(entry, None) is not None:
            self.held_in[delivery.lane] -= 1
            self.room[delivery.lane].set()
            self.settled[entry] = time.monotonic()
            self.settled_at = time.time()
            while len(self.settled) > SETTLED_REMEMBERED:
                del self.settled[next(iter(self.settled))]
        self.metrics.inflight.set(len(self.held))

    def room_in(self, lane: Priority) -> int:  # how many more entries of the lane may be taken
        return self.settings.max_inflight - self.held_in[lane]

    def oldest_taken(self) -> float | None:
        """When the longest-held entry was taken. Any thread: the loop thread may change ``held`` meanwhile."""
        for _ in range(3):
            try:
                return next(iter(self.held.values())).taken if self.held else None
            except (RuntimeError, StopIteration):
                continue
        return None

    def count_lost(self, entries: list[tuple[str, str]]) -> int:
        """Count payload-less pending entries once each (a reclaim and an ack may both see one in the list)."""
        fresh = [entry for entry in entries if entry not in self.lost]
        self.lost.update(dict.fromkeys(fresh))
        while len(self.lost) > LOST_REMEMBERED:
            del self.lost[next(iter(self.lost))]
        self.metrics.lost.inc(len(fresh))
        return len(fresh)

    # ---- the route

    def _route(self, delivery: Delivery) -> None:
        if delivery.payload_gone:  # pending, but trimmed away: nothing to answer with
            log.error("entry %s of %s has no payload any more (trimmed?): acknowledged", delivery.entry_id,
                      delivery.key, extra=delivery.log_fields)
            self.count_lost([(delivery.key, delivery.entry_id)])
            asyncio.ensure_future(self._ack_only(delivery))
        elif not delivery.answerable:  # a part that names no request: its result could go nowhere
            asyncio.ensure_future(self._dead_letter(delivery, delivery.invalid or "no request", answer=False))
        elif delivery.deliveries > self.settings.max_deliveries:
            asyncio.ensure_future(self._dead_letter(delivery, f"delivered {delivery.deliveries} times unfinished"))
        else:  # bad fields too: the planner answers them with the identity its parse finds
            asyncio.ensure_future(self._plan(delivery))

    async def _plan(self, delivery: Delivery) -> None:
        start = time.perf_counter()
        try:
            planned = await asyncio.wrap_future(self.planner.submit(delivery, await self._stored_body(delivery)))
        except Exception as error:  # noqa: BLE001 - a planner bug must not take the daemon down
            log.exception("planning %s failed", delivery.entry_id, extra=delivery.log_fields)
            self._failed(delivery, f"{type(error).__name__}: {error}")
            return
        finally:
            self.metrics.planning.observe(time.perf_counter() - start)
        if isinstance(planned, Refusal):  # bad input, a deadline passed: answered at once, never retried
            self.settle(error_outcome(delivery, planned.identity, planned.code, planned.message, self.model))
        elif stored := delivery.stream == REQUESTS and await self.link.until(
                lambda: self.publisher.stored(planned.request_id), "look up"):  # a reused id: no compute
            outcome = answered_before(planned.delivery, planned.identity, stored, self.model)
            self._count_reused(outcome)
            self.settle(outcome)
        elif planned.fan_out:
            await self.link.until(lambda: self.publisher.fan_out(planned), "fan out")
            self.metrics.fanouts.inc()
            log.debug("fanned %s out in %d parts", planned.request_id, len(planned.fan_out),
                      extra=planned.identity.log_fields)
            self.release(delivery)
        else:
            self._queue(planned)

    def _count_reused(self, outcome: Outcome) -> None:
        self.metrics.reused_ids.labels("conflict" if outcome.result and outcome.result.error else "replay").inc()

    def _queue(self, task: Task) -> None:
        for index, prompt in enumerate(task.prompts):
            self.packer.put(Item(task, index, prompt))

    async def _stored_body(self, delivery: Delivery) -> bytes | None:  # a part's request body (None: gone)
        if delivery.stream != PARTS or not delivery.answerable:
            return None
        return await self.link.until(lambda: self.consumer.stored_body(delivery), "get body")

    def _failed(self, delivery: Delivery, reason: str, task: Task | None = None) -> None:
        """Retry until ``--max-deliveries``, then dead-letter with an error result."""
        if delivery.deliveries >= self.settings.max_deliveries:
            asyncio.ensure_future(self._dead_letter(delivery, reason, task.identity if task else None))
        else:
            self.metrics.retries.inc()
            asyncio.ensure_future(self._retry(delivery, task))

    async def _retry(self, delivery: Delivery, task: Task | None) -> None:
        """Take the entry again (its delivery counter goes up); a planned task is queued again as it was, else it
        is planned again. One trimmed meanwhile is not pending any more (the claim finds nothing): its payload is
        in memory, so it is retried from there, its counter kept here."""
        fresh = await self.link.until(lambda: self.consumer.claim_again(delivery), "claim") or delivery.again()
        self.release(delivery)
        if self._hold(fresh, "retried", None):
            if task is None:
                self._route(fresh)
            else:
                self._queue(Task(fresh, task.identity, task.request, task.prompts, remaining=len(task.prompts)))

    async def _dead_letter(self, delivery: Delivery, reason: str, identity: Identity | None = None,
                           answer: bool = True) -> None:
        """Copy the entry to the dead-letter stream, then answer its request (``answer``) or only acknowledge it."""
        log.error("dead-lettering %s of %s after %d deliveries: %s", delivery.entry_id, delivery.key,
                  delivery.deliveries, reason, extra=delivery.log_fields)
        await self.link.until(lambda: self.publisher.dead_letter(delivery, reason), "dead letter")
        self.metrics.dead_letters.inc()
        if not answer:
            await self._ack_only(delivery)
            return
        if identity is None:  # the body parsed once, off this thread, for where the error result goes
            job = Job.of(delivery, await self._stored_body(delivery))
            identity = (await asyncio.to_thread(identity_of, self.keys, job))[0]
        self.settle(error_outcome(delivery, identity, ErrorCode.DEAD_LETTERED,
                                  f"gave up after {delivery.deliveries} deliveries: {reason}", self.model))

    async def _ack_only(self, delivery: Delivery) -> None:
        await self.link.until(lambda: self.publisher.ack([delivery]), "ack")
        self.release(delivery)

    # ---- compute's sink: called on the GPU thread, handled on this one

    def prompt_done(self, item: Item, answers: list[Answer], seconds: float) -> None:
        self._hop(self._prompt_done, item, answers, seconds)

    def task_failed(self, task: Task, reason: str) -> None:
        self._hop(self._task_failed, task, reason)

    def task_expired(self, task: Task) -> None:
        self._hop(self._task_expired, task)

    def _hop(self, callback: Any, *args: Any) -> None:
        """Onto the loop thread; dropped once a stop past its deadline closed it (the entries stay pending)."""
        try:
            self.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            if not self.loop.is_closed():
                raise

    def _prompt_done(self, item: Item, answers: list[Answer], seconds: float) -> None:
        if (task := item.task).cancelled:
            return
        task.answers.update({answer.name: answer for answer in answers})
        task.compute_seconds += seconds
        task.remaining -= 1
        if task.remaining == 0:
            self.settle(task_outcome(task, self.model))

    def _task_failed(self, task: Task, reason: str) -> None:
        if not task.cancelled:
            task.cancelled = True
            self._failed(task.delivery, reason, task)

    def _task_expired(self, task: Task) -> None:
        if task.cancelled or task.remaining == 0:
            return
        task.cancelled = True
        self.settle(error_outcome(task.delivery, task.identity, ErrorCode.DEADLINE_EXCEEDED,
                                  "the deadline passed before compute", self.model))

    # ---- outcomes: settled in batches, then let go

    def settle(self, outcome: Outcome) -> None:
        self.outcomes.put_nowait(outcome)

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
            for outcome, error in done.replies_refused:  # the result stream holds the result: work goes on
                self.link.refused("reply", error, stalls=False,
                                  detail=f"reply to {(outcome.reply_to or '')[:200]} of {outcome.request_id}")
            now = time.time()
            for outcome in done.reused:  # lost the race to another request under its id: answered as reused
                self._count_reused(outcome)
            for outcome, result, published in done.settled:
                if result is not None and published:
                    code = result.error.code.value if result.error else ""
                    self.metrics.results.labels(result.status, code).inc()
                    self.metrics.latency.labels(result.status, outcome.delivery.lane).observe(
                        max(0.0, now - outcome.delivery.enqueued_ms / 1000))
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("published %s: %s", result.id, code or result.status,
                                  extra=outcome.identity.log_fields)
                # Let go once counted: a scrape (another thread) that sees nothing held sees every result counted.
                self.release(outcome.delivery)

    def _again(self, outcome: Outcome, error: redis.ResponseError) -> None:
        """Settle a refused outcome again later: soon once the function library is loaded again (a server restarted
        empty, FUNCTION FLUSH), else in a second, counted, logged once per interval, the worker unready meanwhile."""
        outcome.refused = None
        if library.missing(error):
            asyncio.ensure_future(self._after_library(outcome))
            return
        self.link.refused("publish", error)
        self.loop.call_later(1.0, self.outcomes.put_nowait, outcome)

    async def _after_library(self, outcome: Outcome) -> None:
        await asyncio.sleep(0.01 if await self.publisher.recheck_library() else 1.0)
        self.outcomes.put_nowait(outcome)
