"""This worker's Redis calls on the consumer group: read, recover its own pending entries, reclaim dead
consumers' entries, keep long work from being reclaimed, claim again for a retry, and the group's stats.
Every entry comes back as a parsed ``Delivery``; what to do with it is the lifecycle's (lifecycle.py).

The calls that hand entries over (``XREADGROUP >``, ``XAUTOCLAIM``) go through a client that never re-sends a
call by itself: a reply lost after Redis delivered would leave its entries pending for this live consumer,
held by no one, and the re-sent call would not return them. Any error there is the caller's doubt: it
recovers its own pending entries next (``own_pending``), which finds them with ``XPENDING`` (no delivery
counter bumped) and takes only those it does not hold (``XCLAIM``, which counts the new delivery).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

import redis

from producer.wire.keys import LANES, Keys, Priority, text
from producer.wire.schema import ErrorCode

from ..entries import PARTS, REQUESTS, Delivery, Stream
from .redis_calls import REDIS_ERRORS


class Consumer:
    """One consumer of the worker group, on the shard's work streams: each lane's part and request streams."""

    def __init__(self, redis_client: Any, keys: Keys, name: str, max_entry_bytes: int | None = None,
                 once: Any = None, max_read_bytes: int | None = None) -> None:
        self.redis = redis_client
        self.once = once or redis_client  # a client that never retries a call: for the calls that hand entries over
        self.keys = keys
        self.name = name
        self.max_entry_bytes = max_entry_bytes  # larger entries are refused unparsed (Delivery.parse)
        # Entries per call that hands entries over, so that one reply brings in about max_read_bytes at most.
        # Redis sends an entry over max_entry_bytes whole, so a lane reads one at a time (``careful``) after
        # a reply with such an entry and after an empty one, until a reply brings none: a burst of huge
        # entries is taken one by one, also when it wakes an idle worker.
        self.per_call = max(1, (max_read_bytes or 0) // max_entry_bytes) if max_read_bytes and max_entry_bytes else None
        self.careful: set[Priority] = set(LANES)
        # stream key -> (kind, lane); high lane first, and in a lane parts first: finish started requests
        self.streams: dict[str, tuple[Stream, Priority]] = {}
        for lane in LANES:
            self.streams[keys.parts_in(lane)] = (PARTS, lane)
            self.streams[keys.requests_in(lane)] = (REQUESTS, lane)
        self.lanes = {lane: [key for key, (_, of) in self.streams.items() if of == lane] for lane in LANES}  # read keys

    async def close(self) -> None:  # the client of its own (the shared one is RedisCalls')
        if self.once is not self.redis:
            await self.once.aclose()

    async def ensure_groups(self, lost: bool = False) -> bool:
        """Create the group on every work stream (and the streams), and this consumer in it: a blocked read
        does not create it on Redis 7.0, so an idle worker would be no consumer of a quiet stream (stats, the
        forget function). True if a group had to be created. At 0-0, so that anything queued before any
        worker ran is read, and anything deleted unread before then is reported; a group ``lost`` under
        running workers is made again just before the stream's first entry (``group_start``)."""
        created = False
        for key in self.streams:
            start, entries_read = await self._restart_point(key) if lost else ("0", None)
            try:
                await self.redis.xgroup_create(key, self.keys.group, id=start, mkstream=True, entries_read=entries_read)
                created = True
            except redis.ResponseError as error:
                if "BUSYGROUP" not in str(error):
                    raise
            await self.redis.xgroup_createconsumer(key, self.keys.group, self.name)
        return created

    async def _restart_point(self, key: str) -> tuple[str, int | None]:
        """``group_start`` of a stream; 0-0 where there is no stream (any more). Not where its slot is
        moving (ASK, TRYAGAIN: raised, waited out): the stream is on the other node, with its group (MIGRATE
        keeps both)."""
        try:
            return group_start(await self.redis.xinfo_stream(key))
        except REDIS_ERRORS:
            raise
        except redis.ResponseError:
            return "0", None

    async def read(self, lane: Priority, count: int, block_ms: int) -> list[Delivery]:
        """New entries (``>``) of one lane, parts before requests."""
        count = 1 if lane in self.careful and self.per_call else self._bounded(count)
        reply = await self.once.xreadgroup(self.keys.group, self.name, {key: ">" for key in self.lanes[lane]},
                                           count=count, block=block_ms)
        deliveries = [self._parse(text(key), text(entry_id), fields, 1)
                      for key, entries in reply or [] for entry_id, fields in entries]
        del reply
        self._brought(deliveries, lane)
        return deliveries

    def _bounded(self, count: int) -> int:
        return count if self.per_call is None else min(count, self.per_call)

    def _brought(self, deliveries: list[Delivery], lane: Priority | None = None) -> None:
        """After a reply: one at a time while huge entries come (``careful``); a big reply's memory given
        back."""
        huge = any(delivery.invalid_code is ErrorCode.TOO_LARGE for delivery in deliveries)
        if lane is not None:
            (self.careful.add if huge or not deliveries else self.careful.discard)(lane)
        if huge or sum(delivery.size for delivery in deliveries) >= RELEASE_BYTES:
            release_memory()

    async def own_pending(self, lane: Priority, limit: int, skip: set[tuple[str, str]]
                          ) -> tuple[list[Delivery], list[tuple[str, str]], bool]:
        """A lane's entries delivered to this consumer and never acknowledged (a restart, a reply lost in
        transit), but those in ``skip`` (held already: their counters are not touched), at most ``limit``,
        claimed again (their counters go up by one: this is a new delivery); (stream key, entry id) of those
        that had no payload any more; and whether some are left for another turn."""
        found: list[tuple[str, str]] = []
        for key in self.lanes[lane]:
            start = "-"
            while len(found) < limit:
                pending = await self.redis.xpending_range(key, self.keys.group, start, "+", 100, self.name)
                if not pending:
                    break
                ids = [text(entry["message_id"]) for entry in pending]
                found += [(key, entry_id) for entry_id in ids if (key, entry_id) not in skip][: limit - len(found)]
                start = "(" + ids[-1]
        deliveries: list[Delivery] = []
        gone: list[tuple[str, str]] = []
        for key in self.lanes[lane]:
            ids = [entry_id for of, entry_id in found if of == key]
            step = self._bounded(len(ids)) or 1
            for start in range(0, len(ids), step):  # claimed in replies of a bounded size
                claimed, lost = await self._claim(key, ids[start: start + step])
                deliveries += claimed
                gone += lost
        return deliveries, gone, len(found) >= limit

    async def _claim(self, key: str, ids: list[str]) -> tuple[list[Delivery], list[tuple[str, str]]]:
        """Own pending entries taken again (XCLAIM: their counters go up); those deleted meanwhile, which
        Redis 7 drops from the pending list instead of returning."""
        reply = await self.redis.xclaim(key, self.keys.group, self.name, 0, ids)
        fields = {text(entry_id): values for entry_id, values in reply or [] if values}
        del reply
        deliveries = await self._counted([(key, entry_id, fields[entry_id]) for entry_id in ids if entry_id in fields])
        self._brought(deliveries)
        return deliveries, [(key, entry_id) for entry_id in ids if entry_id not in fields]

    async def reclaim(self, lane: Priority, min_idle_ms: int, count: int,
                      limit: int) -> tuple[list[Delivery], list[tuple[str, str]]]:
        """A lane's entries idle longer than ``min_idle_ms`` in any consumer's list, now ours, at most
        ``limit`` (each one claimed is held: no more than the lane has room for); and (stream key, entry id)
        of those that had no payload any more (Redis 7 drops them from the pending list itself)."""
        found: list[tuple[str, str, dict]] = []
        gone: list[tuple[str, str]] = []
        for key in self.lanes[lane]:
            cursor = "0-0"
            while len(found) < limit:
                reply = await self.once.xautoclaim(key, self.keys.group, self.name, min_idle_ms, start_id=cursor,
                                                   count=self._bounded(min(count, limit - len(found))))
                cursor, entries = text(reply[0]), reply[1]
                gone += [(key, text(entry_id)) for entry_id in (reply[2] if len(reply) > 2 else [])]
                found += [(key, text(entry_id), fields) for entry_id, fields in entries]
                if cursor == "0-0":
                    break
        deliveries = await self._counted(found)
        del found
        self._brought(deliveries)
        return deliveries, gone

    async def keep_alive(self, deliveries: list[Delivery]) -> None:
        """Reset the idle time of entries still in work so that no one reclaims them (JUSTID: no count
        bump)."""
        by_key: dict[str, list[str]] = {}
        for delivery in deliveries:
            by_key.setdefault(delivery.key, []).append(delivery.entry_id)
        for key, ids in by_key.items():
            await self.redis.xclaim(key, self.keys.group, self.name, 0, ids, justid=True)

    async def claim_again(self, delivery: Delivery) -> Delivery | None:
        """Take an own entry again for a retry: bumps its delivery counter. None if it is gone."""
        claimed, _ = await self._claim(delivery.key, [delivery.entry_id])
        return claimed[0] if claimed else None

    async def stored_body(self, delivery: Delivery) -> bytes | None:
        """A part's request body, stored when its request fanned out (None: gone)."""
        return await self.redis.get(self.keys.body(delivery.request_id))

    async def group_stats(self) -> dict[tuple[Stream, Priority], dict[str, Any]]:
        """Per work stream: its length, the group's pending count and lag, and ``unread_deleted``: the id
        past which entries were deleted before the group read them (None: none were), by ``unread_deleted``.
        XINFO STREAM, which also sends the stream's first and last entries (huge ones too), is asked only
        where the group has not read everything: a valid lag of 0 on a stream with entries means nothing
        unread was there to lose."""
        out = {}
        for key, stream in self.streams.items():
            length = await self.redis.xlen(key)
            entry: dict[str, Any] = {"length": length, "pending": 0, "lag": None, "unread_deleted": None}
            for group in await self.redis.xinfo_groups(key):
                if text(group["name"]) == self.keys.group:
                    entry.update(pending=group["pending"], lag=group.get("lag"))
                    if group.get("lag") != 0 or length == 0:
                        entry["unread_deleted"] = unread_deleted(await self.redis.xinfo_stream(key), group)
            out[stream] = entry
        return out

    async def _counted(self, found: list[tuple[str, str, dict]]) -> list[Delivery]:
        """Deliveries with Redis' delivery counters, as the claims that took them left them."""
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
        return Delivery.parse(kind, key, entry_id, fields or {}, deliveries, self.max_entry_bytes, lane)


# A reply that brought this much, or an entry over --max-entry-bytes: the allocator is asked to give free
# memory back to the system (glibc keeps freed heap pages of a thread's arena otherwise: 100 MB entries once
# left a worker 100 MB larger for good).
RELEASE_BYTES = 32 << 20
_LIBC = ctypes.util.find_library("c")


def release_memory() -> None:
    """``malloc_trim(0)`` where the C library has it (glibc); nothing elsewhere."""
    try:
        ctypes.CDLL(_LIBC).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def entry_order(entry_id: str) -> tuple[int, int]:
    """A stream entry id as what it sorts by (milliseconds, sequence)."""
    millis, _, sequence = entry_id.partition("-")
    return int(millis), int(sequence or 0)


MAX_SEQUENCE = 2**64 - 1


def group_start(stream: dict[str, Any]) -> tuple[str, int | None]:
    """Where a group lost under running workers starts again, and the entries it counts as read (for its
    lag), from the stream's XINFO STREAM: just before its first entry, so that every entry there is read; on
    an empty stream, its last generated id. Not at 0-0: a group made again there took every entry the workers
    had answered and deleted for one deleted before it was read (``unread_deleted``), and paged for requests
    lost that were not (the loss of the group itself is reported apart)."""
    read = int(stream.get("entries-added", 0)) - int(stream["length"]) if "entries-added" in stream else None
    if stream["length"] == 0:
        return text(stream.get("last-generated-id") or "0-0"), read
    millis, sequence = entry_order(text(stream.get("recorded-first-entry-id") or "0-0"))
    if sequence > 0:
        return f"{millis}-{sequence - 1}", read
    return (f"{millis - 1}-{MAX_SEQUENCE}", read) if millis > 0 else ("0", None)


def unread_deleted(stream: dict[str, Any], group: dict[str, Any]) -> str | None:
    """Whether entries the group never read were deleted (XDEL, or a trim: XADD MAXLEN/MINID, XTRIM), from
    XINFO STREAM and the group's XINFO GROUPS; the id that shows it, else None. A worker deletes only entries
    it acknowledged, which the group read: anything past the group's last delivered id was someone else's
    doing.

    - deleted one by one: the stream's largest deleted id is past the last delivered one;
    - trimmed (from the head; a trim moves no deleted id): the stream's first entry is past the last
      delivered one and it holds fewer entries than the group has yet to read (the lag), or none at all
      though later ones were added."""
    last = entry_order(text(group["last-delivered-id"]))
    deleted = text(stream.get("max-deleted-entry-id") or "0-0")
    if entry_order(deleted) > last:
        return deleted
    first = text(stream.get("recorded-first-entry-id") or "0-0")
    generated = text(stream.get("last-generated-id") or "0-0")
    if stream["length"] == 0:
        return generated if entry_order(generated) > last else None
    lag = group.get("lag")
    return first if entry_order(first) > last and lag is not None and lag > stream["length"] else None
