"""Cancels, as this worker learns of them, on the Redis loop thread (docs/PROTOCOL.md, "Cancelling").

Two ways, neither a round trip of its own per entry:

- the take function (producer/wire/records.py), in the round trip that looks an entry up before compute anyway: a
  request entry's stored result with its record, a part's stored body with its request's record. It answers
  whether a cancel came first, and otherwise marks the request taken, atomically with the cancel function: a cancel
  that comes later finds it taken and leaves a notice for the worker that holds it;
- the shard's cancel notices (``Keys.cancels``), read as they come by one blocking read: the requests cancelled
  lately (``recent``) are dropped wherever this worker holds them unpacked (``Lifecycle.cancel``), and an entry of
  one taken later is answered without being planned.

A take refused (an ACL user older than the records: NOPERM) says "not cancelled", counted and logged: an upgrade
in the wrong order never stalls the work.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import redis

from producer.wire import library
from producer.wire.keys import Field, Keys, text
from producer.wire.result import Result

from ..entries import Delivery
from ..tasks import Task
from .redis_calls import REDIS_ERRORS, RedisCalls

log = logging.getLogger("worker")
REMEMBERED = 100_000  # request ids cancelled lately
READ_COUNT = 1000  # notices per read


class Cancels:
    def __init__(self, redis_calls: RedisCalls, keys: Keys, consumer: str, block_ms: int,
                 cancel: Callable[[str], None]) -> None:
        self.redis_calls, self.keys, self.consumer, self.block_ms = redis_calls, keys, consumer, block_ms
        self.cancel = cancel  # what to do with a request cancelled now (the lifecycle drops what it holds of it)
        self.recent: dict[str, None] = {}

    def cancelled(self, request_id: str) -> bool:
        """A notice said so lately."""
        return request_id in self.recent

    async def look_up(self, task: Task) -> tuple[Result | None, bool]:
        """The result the request's id already has (a reused id), and whether it was cancelled before this take;
        one round trip. Not cancelled: the record says this worker has it since it was taken."""
        stored, cancelled = await self._with_take(task.request_id, task.delivery, len(task.fan_out) or 1, (
            "xrange", (self.keys.result(task.request_id),), {"count": 1}))
        return (Result.model_validate_json(stored[0][1][Field.BODY.encode()]) if stored else None), cancelled

    async def part_body(self, delivery: Delivery) -> tuple[bytes | None, bool]:
        """A part's stored request body (None: gone), and whether its request was cancelled."""
        return await self._with_take(delivery.request_id, delivery, 0, ("get", (self.keys.body(delivery.request_id),),
                                                                         {}))

    async def _with_take(self, request_id: str, delivery: Delivery, parts: int,
                         call: tuple[str, tuple[Any, ...], dict[str, Any]]) -> tuple[Any, bool]:
        async with self.redis_calls.redis.pipeline(transaction=False) as pipe:
            method, args, kwargs = call
            getattr(pipe, method)(*args, **kwargs)
            pipe.fcall(library.TAKE, 1, self.keys.record(request_id), delivery.key, delivery.entry_id, self.consumer,
                       int(delivery.taken * 1000), parts)
            found, taken = await pipe.execute(raise_on_error=False)
        if isinstance(found, BaseException):
            raise found
        if isinstance(taken, redis.ResponseError):
            if library.missing(taken):  # the server lost the library: nothing can be published until it is back
                raise taken
            self.redis_calls.refused("take", taken, stalls=False, detail="cancels are not seen at take")
            return found, False
        if isinstance(taken, BaseException):
            raise taken
        return found, taken == 1

    async def run(self) -> None:
        """Until cancelled: read the shard's cancel notices as they come, from the newest one at start (what came
        before is found by the take of whatever this worker takes)."""
        last = None
        while True:
            try:
                if last is None:
                    newest = await self.redis_calls.redis.xrevrange(self.keys.cancels, count=1)
                    last = text(newest[0][0]) if newest else "0-0"
                reply = await self.redis_calls.redis.xread({self.keys.cancels: last}, count=READ_COUNT,
                                                           block=self.block_ms)
            except REDIS_ERRORS as error:
                self.redis_calls.metrics.redis_errors.labels("cancels").inc()
                log.debug("cancel notices: redis unavailable: %s", error)
                await asyncio.sleep(0.5)
                continue
            except redis.ResponseError as error:  # NOPERM (an ACL user older than cancels): counted, logged
                self.redis_calls.refused("cancels", error, stalls=False, detail="cancel notices are not read")
                await asyncio.sleep(5.0)
                continue
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last = text(entry_id)
                    request_id = text(fields.get(Field.REQUEST_ID.encode(), b""))
                    if request_id:
                        self._learn(request_id)

    def _learn(self, request_id: str) -> None:
        self.recent[request_id] = None
        while len(self.recent) > REMEMBERED:
            del self.recent[next(iter(self.recent))]
        self.cancel(request_id)
