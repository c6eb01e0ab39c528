"""The settle loop, on the Redis loop thread: the outcomes the lifecycle hands it are settled in batches (each
result published once, replied to, its entry acknowledged: ``Publisher.settle``), counted, and their entries
let go. An outcome Redis refused is settled again later, never dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis

from producer.wire import library

from ..metrics import STATES, Metrics
from ..outcomes import Outcome
from ..tasks import State, Timeline
from ..traces import Traces
from .held import HeldEntries
from .publisher import Publisher
from .redis_calls import RedisCalls

log = logging.getLogger("worker")
BATCH = 512  # outcomes settled in one go at most


class Settler:
    """The settle loop: outcomes settled in batches, counted, and their entries let go."""

    def __init__(self, publisher: Publisher, redis_calls: RedisCalls, metrics: Metrics, held: HeldEntries,
                 loop: asyncio.AbstractEventLoop, traces: Traces | None = None) -> None:
        self.publisher, self.redis_calls, self.metrics = publisher, redis_calls, metrics
        self.held, self.loop = held, loop
        self.traces = traces  # None: tracing off
        self.outcomes: asyncio.Queue[Outcome] = asyncio.Queue()

    def put(self, outcome: Outcome) -> None:
        """Settle this outcome in a coming batch (the loop thread)."""
        self.held.move(outcome.delivery, State.SETTLING)
        self.outcomes.put_nowait(outcome)

    def count_reused(self, outcome: Outcome) -> None:
        conflict = outcome.result is not None and outcome.result.error is not None
        self.metrics.reused_ids.labels("conflict" if conflict else "replay").inc()

    async def run(self) -> None:
        """Until cancelled: settle what is queued, up to BATCH outcomes at a time; never drop one."""
        while True:
            batch = [await self.outcomes.get()]
            while not self.outcomes.empty() and len(batch) < BATCH:
                batch.append(self.outcomes.get_nowait())
            began = time.time()
            try:
                done = await self.redis_calls.until(lambda: self.publisher.settle(batch), "publish")
            except Exception:  # noqa: BLE001 - a bug, or stopping past the drain: keep the batch, try again
                log.exception("settling %d outcomes failed; trying again in a second", len(batch))
                for outcome in batch:
                    self.loop.call_later(1.0, self.outcomes.put_nowait, outcome)
                continue
            for outcome in batch:  # Redis refused its publication (OOM, NOPERM, ...): the others went on
                if outcome.refused is not None:
                    self._again(outcome, outcome.refused)
            for outcome, error in done.replies_refused:  # the result stream holds the result: work goes on
                self.redis_calls.refused("reply", error, stalls=False,
                                         detail=f"reply to {(outcome.reply_to or '')[:200]} of "
                                                f"{outcome.request_id}")
            for outcome, error in done.unreadable:  # its id holds what no worker wrote: dead-lettered, let go
                self.metrics.unreadable_results.inc()
                # a dead letter's own counted it
                self.metrics.dead_letters.inc(0 if outcome.dead_letter else 1)
                log.error("%s: entry %s of %s dead-lettered unanswered", error, outcome.delivery.entry_id,
                          outcome.delivery.key, extra=outcome.identity.log_fields)
                self.held.release(outcome.delivery)
            for error in done.records_refused:  # the result is published and acknowledged: work goes on
                self.redis_calls.refused("record", error, stalls=False, detail="a record not updated")
            now = time.time()
            for outcome in done.reused:  # lost the race to another request under its id: answered as reused
                self.count_reused(outcome)
            for outcome, result, published in done.settled:
                if result is not None and published:
                    code = result.error.code.value if result.error else ""
                    self.metrics.results.labels(result.status, code).inc()
                    self.metrics.latency.labels(result.status, outcome.delivery.lane).observe(
                        max(0.0, now - outcome.delivery.enqueued_ms / 1000))
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("published %s: %s", result.id, code or result.status,
                                  extra=outcome.identity.log_fields)
                if (line := outcome.timeline) is not None and line.computed:
                    self._states(outcome, line, now)
                if self.traces is not None:  # a result, or a part's share (no result of its own)
                    self.traces.settled(outcome.delivery, outcome.identity.request_id,
                                        outcome.identity.traceparent, result.status if result else None,
                                        result.error.code.value if result and result.error else None,
                                        (began, now))
                # Let go once counted: a scrape (another thread) that sees nothing held sees every result
                # counted.
                self.held.release(outcome.delivery)

    def _states(self, outcome: Outcome, line: Timeline, now: float) -> None:
        """A computed entry's time in each state after it was taken (dq_request_state_seconds)."""
        lane, steps = outcome.delivery.lane, (outcome.delivery.taken, line.queued, line.launched,
                                              line.computed, now)
        for state, began, ended in zip(STATES, steps, steps[1:]):  # each state from one step to the next
            self.metrics.states.labels(state, lane).observe(max(0.0, ended - began))

    def _again(self, outcome: Outcome, error: redis.ResponseError) -> None:
        """Settle a refused outcome again later: soon once the function library is loaded again (a server
        restarted empty, FUNCTION FLUSH), else in a second, counted, logged once per interval, the worker
        unready meanwhile."""
        outcome.refused = None
        if library.missing(error):
            asyncio.ensure_future(self._after_library(outcome))
            return
        self.redis_calls.refused("publish", error)
        self.loop.call_later(1.0, self.outcomes.put_nowait, outcome)

    async def _after_library(self, outcome: Outcome) -> None:
        await asyncio.sleep(0.01 if await self.publisher.library.recheck() else 1.0)
        self.outcomes.put_nowait(outcome)
