"""An entry's life, on the Redis loop thread, which owns every held entry and task (held.py); the GPU thread
only hands its events over (``LoopThread.hand_over``: a pack launched, a prompt computed, a task failed or
expired), to be handled here on the loop (``handle``). Each step sets the held entry's state (``State``, in
capitals below).

    take     TAKEN: held once, however it arrived (read, recovered, reclaimed, retried), then routed: payload trimmed
             away -> acknowledged, counted lost; a part naming no request -> dead-lettered, unanswered; delivered
             over --max-deliveries times -> dead-lettered with an error result; else planned
    plan     PLANNING: the planner parses the body once (threads or processes): a Task, or a Refusal answered at
             once; an id answered before is a replay or a conflict, not computed again; a request cancelled before
             this take (cancels.py) is answered ``cancelled``, never computed
    queue    QUEUED: a task's prompts to the packer; a task over --fanout-tokens is fanned out as parts instead
    compute  COMPUTING: a pack with one of its prompts went to the GPU
    failed   a failed pack: the same task again under a new delivery (its counter up: TAKEN), or dead-lettered
    settle   SETTLING: each outcome handed to the settle loop (settler.py): published once, replied to,
             acknowledged; then the entry is let go (``HeldEntries.release``); so are a dead letter, a
             fan-out's parts and an acknowledgement alone

    cancel   a cancel notice: the request's entries held here and not packed yet (QUEUED, every prompt still with
             the packer) are answered ``cancelled``; packed or settling ones as they are (too late)

Held entries keep the order they were taken in; each lane has room for ``--max-inflight`` of them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from typing import Protocol

from producer.wire.keys import Keys
from producer.wire.result import Unreadable
from producer.wire.schema import ErrorCode

from ..config import Settings
from ..entries import PARTS, REQUESTS, Delivery, Identity, Job, Refusal, identity_with_digest
from ..metrics import Metrics
from ..outcomes import answered_before, error_outcome, task_outcome
from ..tasks import Computed, Expired, Failed, GpuEvent, Item, Launched, State, Task
from ..traces import Traces
from .cancels import Cancels
from .consumer import Consumer
from .held import HeldEntries
from .publisher import Publisher
from .redis_calls import REDIS_ERRORS, RedisCalls
from .settler import Settler

log = logging.getLogger("worker")
ALONE_LOOKED_AT = 8  # entries held at most for one to be planned as alone (the look is a scan)
# A cancelled request's answer, for whoever reads it (a resend under its id after a caller hung up included).
CANCELLED = ("cancelled before it was computed (a DELETE, a cancel call, or a gateway caller that hung up); an id "
             "is answered once: a request meant to run is sent again under a new id")


class Planners(Protocol):
    """Where an entry is planned (plan/planner.py, on the planners' threads or processes)."""

    def submit(self, delivery: Delivery, stored_body: bytes | None = None, alone: bool = False
               ) -> Future[Task | Refusal]: ...


class Packs(Protocol):
    """Where a task's prompts wait for the GPU (gpu/packer.py; any thread may put)."""

    def put(self, items: list[Item], waited: float = 0.0) -> None: ...

    def withdraw(self, task: Task) -> bool: ...


class Lifecycle:
    """Every step of a held entry's life, from taken to let go (the loop thread builds it: thread.py)."""

    def __init__(self, keys: Keys, settings: Settings, metrics: Metrics, redis_calls: RedisCalls,
                 consumer: Consumer, planner: Planners, packer: Packs, publisher: Publisher,
                 held: HeldEntries, settler: Settler, cancels: Cancels, traces: Traces | None = None) -> None:
        self.keys, self.settings, self.metrics, self.redis_calls = keys, settings, metrics, redis_calls
        self.consumer, self.planner, self.packer, self.publisher = consumer, planner, packer, publisher
        self.held, self.settler, self.cancels = held, settler, cancels
        self.model_name = publisher.model_name
        self.traces = traces  # None: tracing off (worker/traces.py)

    def take(self, delivery: Delivery, how: str, since: float | None = None) -> None:
        """Hold an entry and route it, once however it arrived; not one let go ``since`` the call that found
        it."""
        if self.held.hold(delivery, how, since):
            self._route(delivery)

    # ---- the route

    def _route(self, delivery: Delivery) -> None:
        if delivery.payload_gone:  # pending, but trimmed away: nothing to answer with
            log.error("entry %s of %s has no payload any more (trimmed?): acknowledged", delivery.entry_id,
                      delivery.key, extra=delivery.log_fields)
            self.held.count_lost([(delivery.key, delivery.entry_id)])
            self.held.move(delivery, State.SETTLING)
            asyncio.ensure_future(self._ack_only(delivery))
        elif not delivery.answerable:  # a part that names no request: its result could go nowhere
            self.held.move(delivery, State.SETTLING)
            asyncio.ensure_future(self._dead_letter(delivery, delivery.invalid or "no request", answer=False))
        elif delivery.deliveries > self.settings.max_deliveries:
            self.held.move(delivery, State.SETTLING)
            asyncio.ensure_future(self._dead_letter(delivery,
                                                    f"delivered {delivery.deliveries} times unfinished"))
        # a notice before: not even planned
        elif self.cancels.cancelled(delivery.request_id, delivery.enqueued_ms):
            self.held.move(delivery, State.SETTLING)
            asyncio.ensure_future(self._cancelled(delivery))
        else:  # bad fields too: the planner answers them with the identity its parse finds
            self.held.move(delivery, State.PLANNING)
            asyncio.ensure_future(self._plan(delivery))

    async def _plan(self, delivery: Delivery) -> None:
        start, began = time.perf_counter(), time.time()
        body, cancelled = None, False
        # its request's body, and whether it was cancelled
        if delivery.stream == PARTS and delivery.answerable:
            body, cancelled = await self.redis_calls.until(lambda: self.cancels.part_body(delivery), "get body")
        if cancelled:
            await self._cancelled(delivery, body)
            return
        try:
            alone = self._alone(delivery)
            planned = await asyncio.wrap_future(self.planner.submit(delivery, body, alone=alone))
        except Exception as error:  # noqa: BLE001 - a planner bug must not take the daemon down
            log.exception("planning %s failed", delivery.entry_id, extra=delivery.log_fields)
            self._failed(delivery, f"{type(error).__name__}: {error}")
            return
        finally:
            self.metrics.planning.observe(time.perf_counter() - start)
            if self.traces is not None:
                self.traces.planned(delivery, began, time.time())
        try:
            await self._planned(delivery, planned)
        # retried until a stop past its drain deadline gave up: Redis' fault, not the entry's (no delivery
        # counted against it): left pending, as the drain leaves what it could not settle
        except REDIS_ERRORS as error:
            log.warning("%s left pending: %s", delivery.entry_id, error, extra=delivery.log_fields)
            self.held.release(delivery)
        # the id holds what no worker wrote: no result can go there, nor be compared
        except Unreadable as error:
            self.metrics.unreadable_results.inc()
            self.held.move(delivery, State.SETTLING)
            await self._dead_letter(delivery, f"{error}: no result can be published under this id", answer=False)
        # a bug past planning must not leave the entry held for ever
        except Exception as error:  # noqa: BLE001
            log.exception("handling planned %s failed", delivery.entry_id, extra=delivery.log_fields)
            self._failed(delivery, f"{type(error).__name__}: {error}")

    def _alone(self, delivery: Delivery) -> bool:
        """Nothing else held but entries being settled: no pack runs or is about to (a lone caller's next
        request is often taken while its last one, answered already, is still being acknowledged)."""
        held = self.held
        return len(held) <= ALONE_LOOKED_AT and all(
            other.delivery is delivery or other.state == State.SETTLING
            for other in (held.get(entry) for entry in held) if other is not None)

    async def _planned(self, delivery: Delivery, planned: Task | Refusal) -> None:
        """A planned entry's way on: answered at once, a replay or a conflict, fanned out, or queued."""
        if isinstance(planned, Refusal):  # bad input, a deadline passed: answered at once, never retried
            self.settler.put(error_outcome(delivery, planned.identity, planned.code, planned.message,
                                           self.model_name))
            return
        stored, cancelled = None, False
        if delivery.stream == REQUESTS:
            stored, cancelled = await self.redis_calls.until(lambda: self.cancels.take_check(planned), "look up")
        if stored is not None:  # a reused id: no compute
            outcome = answered_before(planned.delivery, planned.identity, stored, self.model_name)
            self.settler.count_reused(outcome)
            self.settler.put(outcome)
        # or a notice meanwhile
        elif cancelled or self.cancels.cancelled(planned.request_id, delivery.enqueued_ms):
            self._drop(delivery, planned.identity)
        elif planned.fan_out:
            self.held.move(delivery, State.SETTLING)  # its parts added, then it is acknowledged
            await self.redis_calls.until(lambda: self.publisher.fan_out(planned), "fan out")
            self.metrics.fanouts.inc()
            log.debug("fanned %s out in %d parts", planned.request_id, len(planned.fan_out),
                      extra=planned.identity.log_fields)
            self.held.release(delivery)
        else:
            self._queue(planned)

    def _queue(self, task: Task) -> None:
        self.held.move(task.delivery, State.QUEUED, task)
        task.timeline.queued = time.time()
        self.packer.put([Item(task, index, prompt) for index, prompt in enumerate(task.prompts)],
                        waited=max(0.0, task.timeline.queued - task.delivery.taken))

    async def _stored_body(self, delivery: Delivery) -> bytes | None:  # a part's request body (None: gone)
        if delivery.stream != PARTS or not delivery.answerable:
            return None
        return await self.redis_calls.until(lambda: self.consumer.stored_body(delivery), "get body")

    def _failed(self, delivery: Delivery, reason: str, task: Task | None = None) -> None:
        """Retry until ``--max-deliveries``, then dead-letter with an error result."""
        if delivery.deliveries >= self.settings.max_deliveries:
            self.held.move(delivery, State.SETTLING)
            asyncio.ensure_future(self._dead_letter(delivery, reason, task.identity if task else None))
        else:
            self.metrics.retries.inc()
            self.held.move(delivery, State.TAKEN)  # taken again once the claim answers
            asyncio.ensure_future(self._retry(delivery, task))

    async def _retry(self, delivery: Delivery, task: Task | None) -> None:
        """Take the entry again (its delivery counter goes up); a planned task is queued again as it was, else
        it is planned again. One trimmed meanwhile is not pending any more (the claim finds nothing): its
        payload is in memory, so it is retried from there, its counter kept here."""
        fresh = await self.redis_calls.until(lambda: self.consumer.claim_again(delivery), "claim") or delivery.again()
        self.held.release(delivery)
        if self.held.hold(fresh, "retried", None):
            if task is None:
                self._route(fresh)
            elif self.cancels.cancelled(task.request_id, fresh.enqueued_ms):
                self._drop(fresh, task.identity)
            else:
                self._queue(Task(fresh, task.identity, task.request, task.prompts, remaining=len(task.prompts)))

    async def _dead_letter(self, delivery: Delivery, reason: str, identity: Identity | None = None,
                           answer: bool = True) -> None:
        """Dead-letter the entry: with its request's ``dead_lettered`` result (``answer``), copied by the
        publication itself (one step on one server, so that a requeue never finds the one without the other);
        else copied, then acknowledged alone."""
        log.error("dead-lettering %s of %s after %d deliveries: %s", delivery.entry_id, delivery.key,
                  delivery.deliveries, reason, extra=delivery.log_fields)
        self.metrics.dead_letters.inc()
        if not answer:
            await self.redis_calls.until(lambda: self.publisher.dead_letter(delivery, reason), "dead letter")
            await self._ack_only(delivery)
            return
        # the body parsed once, off this thread, for where the error result goes and its digest
        if identity is None:
            job = Job.of(delivery, await self._stored_body(delivery))
            identity = await asyncio.to_thread(identity_with_digest, self.keys, job)
        outcome = error_outcome(delivery, identity, ErrorCode.DEAD_LETTERED,
                                f"gave up after {delivery.deliveries} deliveries: {reason}", self.model_name)
        outcome.dead_letter = reason
        self.settler.put(outcome)

    async def _cancelled(self, delivery: Delivery, body: bytes | None = None) -> None:
        """An entry taken after its request's cancel: its body parsed once, off this thread, for where the
        result goes; answered ``cancelled`` unless the body names another request than the notice was for."""
        job = Job.of(delivery, body if body is not None else await self._stored_body(delivery))
        identity = await asyncio.to_thread(identity_with_digest, self.keys, job)
        if identity.request_id == delivery.request_id or self.cancels.cancelled(identity.request_id,
                                                                                  delivery.enqueued_ms):
            self._drop(delivery, identity)
        else:
            self.held.move(delivery, State.PLANNING)
            await self._plan(delivery)

    def _drop(self, delivery: Delivery, identity: Identity) -> None:
        """Answer ``cancelled``: never computed (a cancel honoured)."""
        self.metrics.cancels.labels("honoured").inc()
        self.settler.put(error_outcome(delivery, identity, ErrorCode.CANCELLED, CANCELLED, self.model_name))
        if (held := self.held.get((delivery.key, delivery.entry_id))) is not None:
            held.cancelled = True  # a notice coming now counts it neither honoured again nor too late

    def cancel(self, request_id: str) -> None:
        """A cancel notice: the request's entries held here (enqueued before it: ``Cancels.cancelled``) whose
        prompts all wait in the packer are answered ``cancelled``; those with a prompt packed, or being
        settled, are answered as they are (too late); those still being planned are checked once planned."""
        for held in self.held.of_request(request_id):
            # sent again after: another one
            if not self.cancels.cancelled(request_id, held.delivery.enqueued_ms):
                continue
            task = held.task
            if held.state == State.QUEUED and task is not None and not task.closed and self.packer.withdraw(task):
                task.closed = True
                self._drop(task.delivery, task.identity)
            elif held.state in (State.QUEUED, State.COMPUTING) or (
                    held.state == State.SETTLING and not held.cancelled and not (task and task.fan_out)):
                self.metrics.cancels.labels("too_late").inc()

    async def _ack_only(self, delivery: Delivery) -> None:
        await self.redis_calls.until(lambda: self.publisher.ack([delivery]), "ack")
        self.held.release(delivery)

    # ---- the GPU thread's events: handed over there (LoopThread.hand_over), handled on this thread

    def handle(self, event: GpuEvent) -> None:
        match event:
            case Launched(items, at):
                for task in {id(item.task): item.task for item in items}.values():
                    if not task.closed:
                        task.timeline.launched = at
                        self.held.move(task.delivery, State.COMPUTING)
            case Computed(item, answers, seconds, at):
                if (task := item.task).closed:
                    return
                task.answers.update({answer.name: answer for answer in answers})
                task.compute_seconds += seconds
                task.remaining -= 1
                if task.remaining == 0:
                    task.timeline.computed = at
                    self.settler.put(task_outcome(task, self.model_name))
            case Failed(task, reason):
                if not task.closed:
                    task.closed = True
                    self._failed(task.delivery, reason, task)
            case Expired(task):
                if task.closed or task.remaining == 0:
                    return
                task.closed = True
                self.settler.put(error_outcome(task.delivery, task.identity, ErrorCode.DEADLINE_EXCEEDED,
                                               "the deadline passed before compute", self.model_name))
