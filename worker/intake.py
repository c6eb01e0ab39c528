"""Intake: entries from the worker group into this worker, each one held until its result is settled.

``Consumer`` is this worker's Redis calls on the group (read, recover own pending entries, reclaim dead consumers'
entries, keep long work from being reclaimed, claim again for a retry); every entry comes back as a parsed
``Delivery``. ``Intake`` is the stage on the asyncio thread: one reader per lane (high, normal) takes that lane's
entries while it holds fewer than ``--max-inflight`` of them, so a worker full of normal work still reads a high
request at once; the maintenance loop reclaims, keeps alive, and reports stream stats and the worker's heartbeat.
Each entry taken goes once to ``accept`` (the daemon's route); ``release`` lets it go.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from producer.keys import LANES, Keys, Priority

from .config import Settings
from .entries import PARTS, REQUESTS, Delivery, Stream
from .link import REDIS_ERRORS, Link
from .metrics import Metrics
from .presence import Presence

log = logging.getLogger("worker")
LOST_REMEMBERED = 10_000  # payload-less entries remembered, so that each is counted once
SETTLED_REMEMBERED = 10_000  # entries let go lately, remembered so that a read that began before is not taken again


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Consumer:
    """One consumer of the worker group, on the shard's work streams: each lane's part and request streams."""

    def __init__(self, redis_client: Any, keys: Keys, name: str, max_entry_bytes: int | None = None) -> None:
        self.redis = redis_client
        self.keys = keys
        self.name = name
        self.max_entry_bytes = max_entry_bytes  # larger entries are refused unparsed (Delivery.parse)
        # stream key -> (kind, lane); high lane first, and in a lane parts first: finish started requests
        self.streams: dict[str, tuple[Stream, Priority]] = {}
        for lane in LANES:
            self.streams[keys.parts_in(lane)] = (PARTS, lane)
            self.streams[keys.requests_in(lane)] = (REQUESTS, lane)
        self.lanes = {lane: [key for key, (_, of) in self.streams.items() if of == lane] for lane in LANES}  # read keys

    async def ensure_groups(self) -> bool:
        """Create the group on every work stream (and the streams); True if one had to be created."""
        created = False
        for key in self.streams:
            try:
                await self.redis.xgroup_create(key, self.keys.group, id="0", mkstream=True)
                created = True
            except redis.ResponseError as error:
                if "BUSYGROUP" not in str(error):
                    raise
        return created

    async def read(self, lane: Priority, count: int, block_ms: int) -> list[Delivery]:
        """New entries (``>``) of one lane, parts before requests."""
        reply = await self.redis.xreadgroup(self.keys.group, self.name, {key: ">" for key in self.lanes[lane]},
                                            count=count, block=block_ms)
        return [self._parse(_text(key), _text(entry_id), fields, 1)
                for key, entries in reply or [] for entry_id, fields in entries]

    async def own_pending(self, lane: Priority, count: int, limit: int,
                          skip: set[tuple[str, str]]) -> tuple[list[Delivery], bool]:
        """A lane's entries delivered to this consumer and never acknowledged (a restart, or a reply lost in
        transit), but those in ``skip`` (stream key, entry id: held already), at most ``limit``; and whether some
        are left for another turn."""
        found: list[tuple[str, str, dict]] = []
        for key in self.lanes[lane]:
            cursor = "0"
            while len(found) < limit:
                reply = await self.redis.xreadgroup(self.keys.group, self.name, {key: cursor}, count=count)
                entries = reply[0][1] if reply else []
                if not entries:
                    break
                found += [(key, _text(entry_id), fields) for entry_id, fields in entries
                          if (key, _text(entry_id)) not in skip][: limit - len(found)]
                cursor = _text(entries[-1][0])
        return await self._counted(found), len(found) >= limit

    async def reclaim(self, lane: Priority, min_idle_ms: int, count: int,
                      limit: int) -> tuple[list[Delivery], list[tuple[str, str]]]:
        """A lane's entries idle longer than ``min_idle_ms`` in any consumer's list, now ours, at most ``limit``
        (each one claimed is held: no more than the lane has room for); and (stream key, entry id) of those that
        had no payload any more (Redis 7 drops them from the pending list itself)."""
        found: list[tuple[str, str, dict]] = []
        gone: list[tuple[str, str]] = []
        for key in self.lanes[lane]:
            cursor = "0-0"
            while len(found) < limit:
                reply = await self.redis.xautoclaim(key, self.keys.group, self.name, min_idle_ms,
                                                    start_id=cursor, count=min(count, limit - len(found)))
                cursor, entries = _text(reply[0]), reply[1]
                gone += [(key, _text(entry_id)) for entry_id in (reply[2] if len(reply) > 2 else [])]
                found += [(key, _text(entry_id), fields) for entry_id, fields in entries]
                if cursor == "0-0":
                    break
        return await self._counted(found), gone

    async def keep_alive(self, deliveries: list[Delivery]) -> None:
        """Reset the idle time of entries still in work so that no one reclaims them (JUSTID: no count bump)."""
        by_key: dict[str, list[str]] = {}
        for delivery in deliveries:
            by_key.setdefault(delivery.key, []).append(delivery.entry_id)
        for key, ids in by_key.items():
            await self.redis.xclaim(key, self.keys.group, self.name, 0, ids, justid=True)

    async def claim_again(self, delivery: Delivery) -> Delivery | None:
        """Take an own entry again for a retry: bumps its delivery counter. None if it is gone."""
        reply = await self.redis.xclaim(delivery.key, self.keys.group, self.name, 0, [delivery.entry_id])
        if not reply or not reply[0][1]:
            return None
        [fresh] = await self._counted([(delivery.key, delivery.entry_id, reply[0][1])])
        return fresh

    async def stored_body(self, delivery: Delivery) -> bytes | None:
        """A part's request body, stored when its request fanned out (None: gone)."""
        return await self.redis.get(self.keys.body(delivery.request_id))

    async def group_stats(self) -> dict[tuple[Stream, Priority], dict[str, Any]]:
        out = {}
        for key, stream in self.streams.items():
            entry: dict[str, Any] = {"length": await self.redis.xlen(key), "pending": 0, "lag": None}
            for group in await self.redis.xinfo_groups(key):
                if _text(group["name"]) == self.keys.group:
                    entry.update(pending=group["pending"], lag=group.get("lag"))
            out[stream] = entry
        return out

    async def _counted(self, found: list[tuple[str, str, dict]]) -> list[Delivery]:
        """Deliveries with Redis' delivery counters (reads from history and claims bump them)."""
        if not found:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for key, entry_id, _ in found:
                pipe.xpending_range(key, self.keys.group, entry_id, entry_id, 1)
            replies = await pipe.execute()
        return [self._parse(key, entry_id, fields, int(reply[0]["times_delivered"]) if reply else 1)
                for (key, entry_id, fields), reply in zip(found, replies)]

    def _parse(self, key: str, entry_id: str, fields: dict | None, deliveries: int) -> Delivery:
        kind, lane = self.streams[key]
        return Delivery.parse(self.keys, kind, key, entry_id, fields or {}, deliveries, self.max_entry_bytes, lane)


class Reader:
    """One lane's reader state (loop thread only)."""

    def __init__(self) -> None:
        self.held = 0  # entries of this lane held
        self.room = asyncio.Event()  # set when one of them is released
        self.turn: float | None = None  # its last turn (liveness)
        self.reading_since: float | None = None  # it has waited on Redis since (health: Redis' fault)


class Intake:
    """The held entries (loop thread only) and the two loops that fill them and keep them."""

    def __init__(self, consumer: Consumer, link: Link, settings: Settings, metrics: Metrics,
                 accept: Callable[[Delivery], None], stopping: threading.Event, presence: Presence) -> None:
        self.consumer, self.link, self.settings, self.metrics = consumer, link, settings, metrics
        self.accept = accept
        self.stopping = stopping
        self.presence = presence  # the heartbeat, and forgetting the workers and consumers that are gone
        # (stream key, entry id) -> delivery: read, planned, queued or computing (ids are unique per stream only)
        self.held: dict[tuple[str, str], Delivery] = {}
        self.readers = {lane: Reader() for lane in LANES}
        self.lost: dict[tuple[str, str], None] = {}  # (stream key, entry id) counted as lost, recent ones
        self.settled: dict[tuple[str, str], float] = {}  # (stream key, entry id) -> when let go (monotonic), recent
        self.settled_at: float | None = None  # when an entry was last released (health: is work progressing?)

    @property
    def read_turn(self) -> float | None:
        """The readers' beat for liveness: the oldest turn of a reader not waiting on Redis (None before all have
        turned); a reader in a Redis read counts as turning now."""
        if any(reader.turn is None for reader in self.readers.values()):
            return None
        now = time.time()
        return min(now if reader.reading_since is not None else reader.turn for reader in self.readers.values())

    @property
    def reading_since(self) -> float | None:
        """Since when the readers have waited on Redis, for health: the latest start of a read in progress (one
        answered read means Redis answers); None when none reads, or when a reader that is not reading turned
        before that (it may be stuck: liveness must see it)."""
        reading = [reader.reading_since for reader in self.readers.values() if reader.reading_since is not None]
        idle = [reader.turn or 0.0 for reader in self.readers.values() if reader.reading_since is None]
        if not reading or (idle and min(idle) < max(reading)):
            return None
        return max(reading)

    async def run_reader(self) -> None:
        """Until stopping: one reader per lane."""
        await asyncio.gather(*(self._read(lane) for lane in LANES))

    async def _read(self, lane: Priority) -> None:
        """One lane: own pending entries first (at start, and after a reply may have been lost), then new ones,
        while the lane holds fewer than ``--max-inflight``."""
        settings, reader = self.settings, self.readers[lane]
        recover = True
        while not self.stopping.is_set():
            reader.turn = time.time()
            self.metrics.heartbeat.labels("reader").set(self.read_turn or reader.turn)
            reader.reading_since = None
            room = settings.max_inflight - reader.held
            if room <= 0:
                reader.room.clear()
                try:
                    await asyncio.wait_for(reader.room.wait(), timeout=0.5)
                except asyncio.TimeoutError:
                    pass
                continue
            reader.reading_since, since = time.time(), time.monotonic()
            try:
                if recover:  # at most ``room`` of them: the rest on the next turns
                    deliveries, recover = await self.consumer.own_pending(lane, min(settings.read_count, room), room,
                                                                          set(self.held))
                    how = "recovered"
                else:
                    deliveries = await self.consumer.read(lane, min(settings.read_count, room), settings.block_ms)
                    how = "read"
                self.link.answered()
            except redis.ResponseError as error:
                if "NOGROUP" not in str(error):
                    raise
                await self._group_lost()
                continue
            except REDIS_ERRORS as error:
                self.link.failed("read", error)
                recover = True
                await asyncio.sleep(0.5)
                continue
            for delivery in deliveries:
                self.take(delivery, how, since)

    async def run_maintenance(self) -> None:
        """Until cancelled: keep held entries alive, reclaim dead consumers' entries; stats and heartbeat every 5 s."""
        settings = self.settings
        every = max(0.1, min(5.0, settings.claim_idle_ms / 4000))
        last_stats = float("-inf")
        while True:
            self.metrics.heartbeat.labels("maintenance").set(time.time())
            try:
                await self.consumer.keep_alive(list(self.held.values()))
                since = time.monotonic()
                reclaimed, gone = [], []
                for lane, reader in self.readers.items():  # claims beyond a lane's room would exceed --max-inflight
                    found, lost_here = await self.consumer.reclaim(lane, settings.claim_idle_ms, settings.read_count,
                                                                   settings.max_inflight - reader.held)
                    reclaimed += found
                    gone += lost_here
                # An entry held in memory (or settled since the reclaim began) is answered from memory, not lost:
                # a held entry trimmed while it computes can be reported gone before keep_alive drops it.
                gone = [entry for entry in gone if not self._known(entry, since)]
                if lost := self.count_lost(gone):
                    log.error("%d pending entries had no payload any more (trimmed?)", lost)
                fresh = [d for d in reclaimed if (d.key, d.entry_id) not in self.held]
                if fresh:  # one line per reclaim, not one per entry (a dead worker may have held hundreds)
                    log.info("reclaimed %d entries from consumers idle over %d ms", len(fresh), settings.claim_idle_ms)
                for delivery in fresh:
                    log.debug("reclaimed %s of %s (delivery %d)", delivery.entry_id, delivery.key, delivery.deliveries,
                              extra=delivery.log_fields)
                    self.take(delivery, "reclaimed", since)
                if time.monotonic() - last_stats > 5:
                    last_stats = time.monotonic()
                    await self._report()
            except redis.ResponseError as error:
                if "NOGROUP" in str(error):  # not left to the reader: it may be waiting for room, not reading
                    await self._group_lost()
                else:  # e.g. OOM refusing the heartbeat: counted, logged once per interval
                    self.link.refused("maintenance", error, stalls=False)
            except REDIS_ERRORS as error:
                self.metrics.redis_errors.labels("maintenance").inc()
                log.debug("maintenance: redis unavailable: %s", error)
            await asyncio.sleep(every)

    def take(self, delivery: Delivery, how: str, since: float | None = None) -> None:
        """Hold an entry and hand it to ``accept``, once however many ways it arrived (read, recovered, ...).
        ``since``: when the read that found it began; an entry let go since then was settled meanwhile (the read of
        own pending entries, or a reclaim, saw it before its acknowledgement), and is not taken again."""
        if self._known((delivery.key, delivery.entry_id), since):
            return
        self.held[delivery.key, delivery.entry_id] = delivery
        self.readers[delivery.lane].held += 1
        metrics = self.metrics
        metrics.inflight.set(len(self.held))
        metrics.entries.labels(delivery.stream, how).inc()
        if delivery.deliveries > 1:
            metrics.redeliveries.labels(delivery.stream).inc()
        else:
            metrics.queue_wait.labels(delivery.lane).observe(max(0.0, delivery.taken - delivery.enqueued_ms / 1000))
        self.accept(delivery)

    def _known(self, entry: tuple[str, str], since: float | None) -> bool:
        """Held now, or let go since ``since`` (when the Redis call that reported the entry began)."""
        return entry in self.held or (since is not None and self.settled.get(entry, float("-inf")) >= since)

    def release(self, delivery: Delivery) -> None:
        entry = (delivery.key, delivery.entry_id)
        if self.held.pop(entry, None) is not None:
            reader = self.readers[delivery.lane]
            reader.held -= 1
            reader.room.set()
            self.settled[entry] = time.monotonic()
            self.settled_at = time.time()
            while len(self.settled) > SETTLED_REMEMBERED:
                del self.settled[next(iter(self.settled))]
        self.metrics.inflight.set(len(self.held))

    async def retry(self, delivery: Delivery) -> None:
        """Take an own entry again (its delivery counter goes up) and hand it to ``accept`` as a new delivery. One
        trimmed meanwhile is not pending any more (the claim finds nothing): its payload is in memory, so it is
        retried from there, its counter kept here, and answered like any held entry that was trimmed."""
        fresh = await self.link.until(lambda: self.consumer.claim_again(delivery), "claim")
        self.release(delivery)
        if fresh is None:
            fresh = dataclasses.replace(delivery, deliveries=delivery.deliveries + 1, taken=time.time())
        self.take(fresh, "retried")

    def oldest_taken(self) -> float | None:
        """When the longest-held entry was taken (held keeps the order entries were taken in). Any thread."""
        for _ in range(3):  # another thread reads: the loop thread may change ``held`` meanwhile
            try:
                return next(iter(self.held.values())).taken if self.held else None
            except (RuntimeError, StopIteration):
                continue
        return None

    def count_lost(self, entries: list[tuple[str, str]]) -> int:
        """Count payload-less pending entries once each: a reclaim may report an entry that the reader is acking
        as lost at the same moment (both saw it in the pending list)."""
        fresh = [entry for entry in entries if entry not in self.lost]
        self.lost.update(dict.fromkeys(fresh))
        while len(self.lost) > LOST_REMEMBERED:
            del self.lost[next(iter(self.lost))]
        self.metrics.lost.inc(len(fresh))
        return len(fresh)

    async def start(self) -> None:
        """Create the group on every work stream unless it is there (waits for Redis)."""
        await self.link.until(self.consumer.ensure_groups, "create groups")

    async def stored_body(self, delivery: Delivery) -> bytes | None:
        return await self.link.until(lambda: self.consumer.stored_body(delivery), "get body")

    async def leave(self) -> None:
        """Take this worker's heartbeat out of Keys.workers (on a clean stop)."""
        await self.presence.leave()

    async def _group_lost(self) -> None:
        """Redis lost the group (a restart without persistence, a failover to an empty replica): recreate it once,
        whichever loop noticed first, and report the loss."""
        if await self.link.until(self.consumer.ensure_groups, "create groups"):
            log.error("consumer group missing (Redis lost its data?): recreated it; entries not yet read are lost")
            self.metrics.groups_recreated.inc()

    async def _report(self) -> None:
        """Stream lengths, pending and lag as metrics; this worker's heartbeat; the gone forgotten."""
        self.metrics.streams(await self.consumer.group_stats())
        await self.presence.beat(len(self.held))
        consumers, beats = await self.presence.forget_the_gone()
        if consumers or beats:  # one line per clean-up (after a scale-down, several at once)
            log.info("forgot workers that are gone: consumers %s (nothing pending, idle over %d ms), heartbeats %s",
                     ", ".join(consumers) or "-", self.settings.consumer_gone_ms, ", ".join(beats) or "-")
