"""Results, where every entry ends: a task's answers gathered into an outcome, published exactly once and
acknowledged (publisher.py, the Redis side), a refused publication tried again. ``Results`` is the stage on the
asyncio thread, and compute's sink.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import redis

from producer import library
from producer.schema import ErrorCode, Request, Result, Timings

from .entries import Delivery
from .link import REDIS_ERRORS, Link
from .metrics import Metrics
from .publisher import Outcome, Publisher, ok_result
from .tasks import Item, Task

if TYPE_CHECKING:
    from .model.readout import Answer

log = logging.getLogger("worker")
BATCH = 512  # outcomes settled in one go at most


def share(task: Task) -> dict[str, Any]:
    """A task's answers as JSON-ready dicts (a whole result's fields, or a part's share of them)."""
    answers = task.answers
    return {
        "answers": {n: a.answer for n, a in answers.items()},
        "logits": {n: a.logits for n, a in answers.items()},
        "probabilities": {n: a.probabilities for n, a in answers.items()},
        "options": {n: a.options for n, a in answers.items()},
        "tokens": task.tokens, "prompts": len(task.prompts),
        "compute_ms": round(task.compute_seconds * 1000, 3), "started_ms": int(task.delivery.taken * 1000),
    }


def echo(delivery: Delivery, request: Request | None = None) -> dict[str, Any]:
    """The caller's context a result echoes (metadata, traceparent): the parsed request's, else what was read of it
    when the entry was taken (so the error result of a bad request echoes what was valid in it)."""
    source: Request | Delivery = request if request is not None else delivery
    return {"metadata": source.metadata, "traceparent": source.traceparent}


def task_outcome(task: Task, model: str) -> Outcome:
    order, context = list(task.request.questions), echo(task.delivery, task.request)
    if task.parts > 1:
        return Outcome(task.delivery, task.request.reply_to, part=(task.part, task.parts, share(task)), order=order,
                       echo=context)
    names = [q.name for prompt in task.prompts for q in prompt.questions]
    result = ok_result(task.request_id, [share(task)], names, task.delivery.enqueued_ms, model, context)
    return Outcome(task.delivery, task.request.reply_to, result=result)


def error_outcome(delivery: Delivery, code: ErrorCode, message: str, model: str, request: Request | None = None,
                  reply_to: str | None = None) -> Outcome:
    """An error result for the entry's request; its reply stream (unless given) and echoed context are the parsed
    request's when there is one, else the delivery's."""
    timings = Timings(enqueued_ms=delivery.enqueued_ms, started_ms=int(delivery.taken * 1000),
                      finished_ms=int(time.time() * 1000))
    if reply_to is None:
        reply_to = request.reply_to if request is not None else delivery.reply_to
    return Outcome(delivery, reply_to, result=Result.failure(delivery.request_id, code, message, timings=timings,
                                                             model=model, **echo(delivery, request)))


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
        self.library_logged = float("-inf")
        self._checking: asyncio.Future[bool] | None = None
        publisher.reply_refused = self.reply_refused

    # ---- compute's sink (GPU thread)

    def prompt_done(self, item: Item, answers: list[Answer], seconds: float) -> None:
        self._hand_over(self._prompt_done, item, answers, seconds)

    def task_failed(self, task: Task, reason: str) -> None:
        self._hand_over(self._task_failed, task, reason)

    def task_expired(self, task: Task) -> None:
        self._hand_over(self._task_expired, task)

    def _hand_over(self, callback: Any, *args: Any) -> None:
        """To the loop thread. A stop past its drain deadline closes the loop while a pack may still finish: its
        entries stay pending (the stop's last word counts them) and other workers reclaim them."""
        try:
            self.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            if not self.loop.is_closed():
                raise

    # ---- loop thread

    def _prompt_done(self, item: Item, answers: list[Answer], seconds: float) -> None:
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

    async def dead_letter(self, delivery: Delivery, reason: str, answer: bool = True) -> None:
        """Copy the entry to the dead-letter stream, then answer its request (``answer``) or only acknowledge it."""
        log.error("dead-lettering %s of %s after %d deliveries: %s", delivery.entry_id, delivery.key,
                  delivery.deliveries, reason, extra=delivery.log_fields)
        await self.link.until(lambda: self.publisher.dead_letter(delivery, reason), "dead letter")
        self.metrics.dead_letters.inc()
        if not answer:
            await self.ack_only(delivery)
            return
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
                if result is not None and published:
                    code = result.error.code.value if result.error else ""
                    self.metrics.results.labels(result.status, code).inc()
                    self.metrics.latency.labels(result.status, outcome.delivery.lane).observe(
                        max(0.0, now - outcome.delivery.enqueued_ms / 1000))
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("published %s: %s", result.id, code or result.status,
                                  extra=outcome.delivery.log_fields)
                # Let go once counted: a scrape (another thread) that sees nothing held sees every result counted.
                self.release(outcome.delivery)

    def _again(self, outcome: Outcome, error: redis.ResponseError) -> None:
        """Settle a refused outcome again later: soon once the function library is loaded again (a server restarted
        empty, FUNCTION FLUSH: loaded by this worker where its user may, else unready until an admin does), else in
        a second, counted, logged once per interval, and the worker unready meanwhile."""
        outcome.refused = None
        if library.missing(error):
            asyncio.ensure_future(self._after_library(outcome))
            return
        self.link.refused("publish", error)
        self.loop.call_later(1.0, self.outcomes.put_nowait, outcome)

    async def _after_library(self, outcome: Outcome) -> None:
        if self._checking is None or self._checking.done():  # one check for every outcome refused meanwhile
            self._checking = asyncio.ensure_future(self.check_library())
        await asyncio.sleep(0.01 if await asyncio.shield(self._checking) else 1.0)
        self.outcomes.put_nowait(outcome)

    def reply_refused(self, outcome: Outcome, error: Exception) -> None:
        """A reply Redis refused (its stream is a key of another type, an ACL, memory): counted, logged once per
        interval, dropped: the result stream holds the result, and the work goes on."""
        self.link.refused("reply", error, stalls=False,
                          detail=f"reply to {(outcome.reply_to or '')[:200]} of {outcome.delivery.request_id}")
