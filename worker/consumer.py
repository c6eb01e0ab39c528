"""This worker's Redis calls on the consumer group: read, recover its own pending entries, reclaim dead consumers'
entries, keep long work from being reclaimed, claim again for a retry, and the group's stats. Every entry comes
back as a parsed ``Delivery``; what to do with it is the lifecycle's (lifecycle.py).
"""

from __future__ import annotations

from typing import Any

import redis

from producer.keys import LANES, Keys, Priority, text

from .entries import PARTS, REQUESTS, Delivery, Stream


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
        return [self._parse(text(key), text(entry_id), fields, 1)
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
                found += [(key, text(entry_id), fields) for entry_id, fields in entries
                          if (key, text(entry_id)) not in skip][: limit - len(found)]
                cursor = text(entries[-1][0])
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
                cursor, entries = text(reply[0]), reply[1]
                gone += [(key, text(entry_id)) for entry_id in (reply[2] if len(reply) > 2 else [])]
                found += [(key, text(entry_id), fields) for entry_id, fields in entries]
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
                if text(group["name"]) == self.keys.group:
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
        return Delivery.parse(kind, key, entry_id, fields or {}, deliveries, self.max_entry_bytes, lane)
