"""Cancels, as this worker learns of them, on the Redis loop thread (docs/PROTOCOL.md, "Cancelling").

Two ways, neither a round trip of its own per entry:

- the take: the request's cancel mark (its record, producer/wire/records.py), read in the round trip that
  looks an entry up before compute anyway (a request entry's stored result, a part's stored body), with the
  record's note of who took it since when. The cancel function answers `cancelled` only for an entry not yet
  delivered, whose reader is bound to see the mark here; a delivered one it leaves to its worker, with a
  notice;
- the shard's cancel notices (``Keys.cancels``), read as they come by one blocking read: the requests
  cancelled lately (``recent``) are dropped wherever this worker holds them unpacked (``Lifecycle.cancel``),
  and an entry of one taken later is answered without being planned.

A take Redis refuses (an ACL user older than records: NOPERM) says "not cancelled", counted and logged: an
upgrade in the wrong order never stalls the work.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import redis

from producer.plumbing.commands import Command, Pipeline, apipelined, command, hset
from producer.wire.keys import Field, Keys, Record, RecordState, text
from producer.wire.result import Result, read_stored

from ..entries import Delivery
from ..tasks import Task
from .redis_calls import REDIS_ERRORS, RedisCalls

log = logging.getLogger("worker")
REMEMBERED = 100_000  # request ids cancelled lately
READ_COUNT = 1000  # notices per read


class Cancels:
    """The cancels this worker learns of: at the take, and from the shard's cancel notices."""

    def __init__(self, redis_calls: RedisCalls, keys: Keys, consumer: str, block_ms: int,
                 cancel: Callable[[str], None]) -> None:
        self.redis_calls, self.keys, self.consumer, self.block_ms = redis_calls, keys, consumer, block_ms
        # what to do with a request cancelled now (the lifecycle drops what it holds of it)
        self.cancel = cancel
        self.recent: dict[str, int] = {}  # request id -> when its cancel came (ms, the notice's entry id)

    def cancelled(self, request_id: str, enqueued_ms: int) -> bool:
        """A notice said so lately, for a request enqueued before it (one sent again under the id after its
        cancel is another request)."""
        return enqueued_ms <= self.recent.get(request_id, -1)

    async def take_check(self, task: Task) -> tuple[Result | None, bool]:
        """The whole check at a request's take, in one round trip: the result its id already has (a reused id:
        a replay or a conflict), whether a cancel came, and the record noted with who took it since when (a
        fan-out: into how many parts)."""
        delivery, record = task.delivery, self.keys.record(task.request_id)
        took: dict[str, Any] = {Record.STREAM: delivery.key, Record.ENTRY: delivery.entry_id,
                                Record.CONSUMER: self.consumer, Record.SINCE: int(delivery.taken * 1000)}
        if task.fan_out:
            took.update({Record.STATE: RecordState.FANNED_OUT, Record.PARTS: len(task.fan_out)})
        stored, cancelled = await self._with_mark(
            task.request_id, command("XRANGE", self.keys.result(task.request_id), "-", "+", "COUNT", 1),
            hset(record, took))
        # Unreadable for what no worker wrote (lifecycle dead-letters the entry: nothing can be published
        # there)
        return (read_stored(stored[0][1].get(Field.BODY.encode()), task.request_id) if stored
                else None), cancelled

    async def part_body(self, delivery: Delivery) -> tuple[bytes | None, bool]:
        """A part's stored request body (None: gone), and whether its request was cancelled."""
        return await self._with_mark(delivery.request_id, command("GET", self.keys.body(delivery.request_id)))

    async def _with_mark(self, request_id: str, *calls: Command) -> tuple[Any, bool]:
        """The first call's answer, and the request's cancel mark read in the same pipeline (after the
        calls)."""
        mark = command("HGET", self.keys.record(request_id), Record.CANCELLED)
        replies = await apipelined(self.redis_calls.redis, Pipeline([*calls, mark], raising=False))
        found, mark = replies[0], replies[-1]
        if isinstance(found, BaseException):
            raise found
        for reply in replies[1:]:
            if isinstance(reply, REDIS_ERRORS):  # e.g. TRYAGAIN while the record's slot moves: waited out
                raise reply
            # an ACL user older than records: counted, never stalls
            if isinstance(reply, redis.ResponseError):
                self.redis_calls.refused("take", reply, stalls=False, detail="cancels are not seen at take")
                return found, False
            if isinstance(reply, BaseException):
                raise reply
        return found, bool(mark)

    async def run(self) -> None:
        """Until cancelled: read the shard's cancel notices as they come, from the newest one at start (what
        came before is found by the take of whatever this worker takes)."""
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
                        self._learn(request_id, int(last.split("-")[0]))

    def _learn(self, request_id: str, at_ms: int) -> None:
        self.recent.pop(request_id, None)
        self.recent[request_id] = at_ms
        while len(self.recent) > REMEMBERED:
            del self.recent[next(iter(self.recent))]
        self.cancel(request_id)
