"""Intake: entries from the worker group into the lifecycle, on the Redis loop thread.

One reader per lane (high, normal) takes that lane's entries while the lane has room (``--max-inflight``
held), so a worker full of normal work still reads a high request at once; the maintenance loop keeps held
entries from being reclaimed, reclaims dead consumers' entries, and reports stream stats and the worker's
heartbeat. Each entry found goes to ``Lifecycle.take``, which holds and routes it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import redis

from producer.wire.keys import LANES, Priority

from ..config import Settings
from ..metrics import Metrics
from .consumer import Consumer
from .lifecycle import Lifecycle
from .presence import Presence
from .redis_calls import REDIS_ERRORS, RedisCalls

log = logging.getLogger("worker")


REFUSED_READ_PAUSE_S = 1.0  # between reads Redis refused


def group_gone(error: redis.ResponseError) -> bool:
    """The group or its stream is gone: NOGROUP; or, on Redis 7.0, a blocked read ended by the stream's
    deletion (``UNBLOCKED the stream key no longer exists``; Valkey and later Redis answer NOGROUP)."""
    message = str(error)
    return "NOGROUP" in message or ("UNBLOCKED" in message and "no longer exists" in message)


class Reader:
    """One lane's reader state, for liveness and health."""

    def __init__(self) -> None:
        self.turn: float | None = None  # its last turn
        self.reading_since: float | None = None  # it has waited on Redis since (health: Redis' fault)
        self.empty_since: float | None = None  # its last read of new entries, begun then (time()), found none
        # own pending entries first: at start, and after any doubt (a call's reply may be lost)
        self.recover = True


class Intake:
    """The readers of each lane and the maintenance loop: entries from the group into the lifecycle."""

    def __init__(self, consumer: Consumer, lifecycle: Lifecycle, redis_calls: RedisCalls, settings: Settings,
                 metrics: Metrics, stopping: threading.Event, presence: Presence) -> None:
        self.consumer, self.lifecycle, self.redis_calls = consumer, lifecycle, redis_calls
        self.settings, self.metrics = settings, metrics
        self.stopping = stopping
        self.presence = presence  # the heartbeat, and forgetting the workers and consumers that are gone
        self.readers = {lane: Reader() for lane in LANES}
        self.recreating = asyncio.Lock()  # one recreation of a lost group, whichever loop noticed first
        # Set once every reader has taken back its own pending entries: only then does the maintenance loop
        # reclaim, so that what a reclaim moves to this consumer is not found again as its own meanwhile.
        self.recovered = asyncio.Event()
        self.unread_deleted: dict[tuple[str, str], str] = {}  # per stream: the deleted entry last reported

    @property
    def read_turn(self) -> float | None:
        """The readers' beat for liveness: the oldest turn of a reader not waiting on Redis (None before all
        have turned); a reader in a Redis read counts as turning now."""
        if any(reader.turn is None for reader in self.readers.values()):
            return None
        now = time.time()
        readers = self.readers.values()
        return min(now if reader.reading_since is not None else reader.turn for reader in readers)

    @property
    def reading_since(self) -> float | None:
        """Since when the readers have waited on Redis, for health: the latest start of a read in progress
        (one answered read means Redis answers); None when none reads, or when a reader that is not reading
        turned before that (it may be stuck: liveness must see it)."""
        readers = self.readers.values()
        reading = [reader.reading_since for reader in readers if reader.reading_since is not None]
        idle = [reader.turn or 0.0 for reader in readers if reader.reading_since is None]
        if not reading or (idle and min(idle) < max(reading)):
            return None
        return max(reading)

    @property
    def streams_empty_since(self) -> float | None:
        """Every lane's last read of new entries found none; the earliest start of those reads (burst
        runs)."""
        starts = [reader.empty_since for reader in self.readers.values()]
        return None if None in starts else min(starts)  # type: ignore[type-var]

    async def run_reader(self) -> None:
        """Until stopping: one reader per lane."""
        await asyncio.gather(*(self._read(lane) for lane in LANES))

    async def _read(self, lane: Priority) -> None:
        """One lane: own pending entries first (at start, and after a reply may have been lost), then new
        ones, while the lane has room."""
        settings, reader, lifecycle = self.settings, self.readers[lane], self.lifecycle
        while not self.stopping.is_set():
            reader.turn = time.time()
            self.metrics.heartbeat.labels("reader").set(self.read_turn or reader.turn)
            reader.reading_since = None
            room = lifecycle.held.room_in(lane)
            if room <= 0:
                lifecycle.held.room[lane].clear()
                try:
                    await asyncio.wait_for(lifecycle.held.room[lane].wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass
                continue
            reader.reading_since, since = time.time(), time.monotonic()
            try:
                if reader.recover:  # at most ``room`` of them: the rest on the next turns
                    deliveries, gone, reader.recover = await self.consumer.own_pending(lane, room, set(lifecycle.held))
                    self._lost([entry for entry in gone if not lifecycle.held.known(entry, since)])
                    how = "recovered"
                    if not any(each.recover for each in self.readers.values()):
                        self.recovered.set()
                else:
                    deliveries = await self.consumer.read(lane, min(settings.read_count, room), settings.block_ms)
                    reader.empty_since, how = None if deliveries else reader.reading_since, "read"
                self.redis_calls.answered()
            except REDIS_ERRORS as error:
                self.redis_calls.failed("read", error)
                self.doubt()
                await asyncio.sleep(0.5)
                continue
            except redis.ResponseError as error:
                if group_gone(error):
                    await self._group_lost()
                    continue
                # Refused (MISCONF after a failed save, NOPERM, a primary turned replica): it lasts until an
                # operator or a failover acts, and ending the worker would only begin a crash loop: unready,
                # and read again.
                self.redis_calls.refused("read", error)
                await self.redis_calls.reconnect_if_demoted(error, self.consumer.redis, self.consumer.once)
                self.doubt()
                await asyncio.sleep(REFUSED_READ_PAUSE_S)
                continue
            for delivery in deliveries:
                lifecycle.take(delivery, how, since)

    def doubt(self) -> None:
        """A call that hands entries over failed: its reply may have been lost after Redis delivered them.
        Every reader recovers its own pending entries next."""
        for reader in self.readers.values():
            reader.recover = True

    def _lost(self, gone: list[tuple[str, str]]) -> None:
        if lost := self.lifecycle.held.count_lost(gone):
            log.error("%d pending entries had no payload any more (trimmed?)", lost)

    async def run_maintenance(self) -> None:
        """Until cancelled: keep held entries alive, reclaim dead consumers' entries; stats and heartbeat
        every 5 s."""
        settings, lifecycle = self.settings, self.lifecycle
        every = max(0.1, min(5.0, settings.claim_idle_ms / 4000))
        last_stats = float("-inf")
        await self.recovered.wait()
        while True:
            self.metrics.heartbeat.labels("maintenance").set(time.time())
            try:
                await self.consumer.keep_alive(lifecycle.held.deliveries())
                since = time.monotonic()
                reclaimed, gone = [], []
                for lane in LANES if not self.stopping.is_set() else ():  # a drain takes nothing new
                    try:  # claims beyond a lane's room would exceed --max-inflight
                        found, lost_here = await self.consumer.reclaim(
                            lane, settings.claim_idle_ms, settings.read_count, lifecycle.held.room_in(lane))
                    except REDIS_ERRORS:
                        self.doubt()  # what it claimed before the error is pending here, held by no one
                        raise
                    reclaimed += found
                    gone += lost_here
                # An entry held in memory (or settled since the reclaim began) is answered from memory, not
                # lost: a held entry trimmed while it computes can be reported gone before keep_alive drops
                # it.
                self._lost([entry for entry in gone if not lifecycle.held.known(entry, since)])
                fresh = [d for d in reclaimed if (d.key, d.entry_id) not in lifecycle.held]
                if fresh:  # one line per reclaim, not one per entry (a dead worker may have held hundreds)
                    log.info("reclaimed %d entries from consumers idle over %d ms", len(fresh), settings.claim_idle_ms)
                for delivery in fresh:
                    log.debug("reclaimed %s of %s (delivery %d)", delivery.entry_id, delivery.key, delivery.deliveries,
                              extra=delivery.log_fields)
                    lifecycle.take(delivery, "reclaimed", since)
                if time.monotonic() - last_stats > 5:
                    last_stats = time.monotonic()
                    await self._report()
            except REDIS_ERRORS as error:
                self.metrics.redis_errors.labels("maintenance").inc()
                log.debug("maintenance: redis unavailable: %s", error)
            except redis.ResponseError as error:
                if group_gone(error):  # not left to the reader: it may be waiting for room, not reading
                    await self._group_lost()
                else:  # e.g. OOM refusing the heartbeat: counted, logged once per interval
                    self.redis_calls.refused("maintenance", error, stalls=False)
            await asyncio.sleep(every)

    async def start(self) -> None:
        """Create the group on every work stream unless it is there (waits for Redis)."""
        await self.redis_calls.until(self.consumer.ensure_groups, "create groups")

    async def _group_lost(self) -> None:
        """Redis lost the group (a restart without persistence, a failover to an empty replica): recreate it
        once, whichever loop noticed first, and report the loss."""
        async with self.recreating:
            if await self.redis_calls.until(lambda: self.consumer.ensure_groups(lost=True), "create groups"):
                log.error("consumer group missing (Redis lost its data?): recreated it; entries not yet read are "
                          "lost")
                self.metrics.groups_recreated.inc()

    async def _report(self) -> None:
        """Stream lengths, pending and lag as metrics; this worker's heartbeat; the gone forgotten."""
        stats = await self.consumer.group_stats()
        self.metrics.streams(stats)
        for (stream, lane), found in stats.items():
            deleted = found["unread_deleted"]
            if deleted is not None and self.unread_deleted.get((stream, lane)) != deleted:
                self.unread_deleted[stream, lane] = deleted
                self.metrics.unread_deleted.labels(stream, lane).inc()
                log.error("entries of the %s lane's %s stream were deleted before the group read them (up to %s): "
                          "requests lost unanswered; only a user with XADD MAXLEN/MINID, XTRIM or XDEL on the stream "
                          "can do this (docs/OPERATIONS.md, what the roles cannot stop)", lane, stream, deleted)
        await self.presence.beat(len(self.lifecycle.held))
        consumers, beats = await self.presence.forget_the_gone()
        if consumers or beats:  # one line per clean-up (after a scale-down, several at once)
            log.info("forgot workers that are gone: consumers %s (nothing pending, idle over %d ms), heartbeats %s",
                     ", ".join(consumers) or "-", self.settings.consumer_gone_ms, ", ".join(beats) or "-")
