"""Intake: read entries from the worker group, recover own pending entries, reclaim dead consumers' entries,
and keep this worker's long-running entries from being reclaimed by others. All calls are asyncio Redis calls."""

from __future__ import annotations

from typing import Any

import redis

from producer.keys import Keys

from .tasks import CHUNKS, REQUESTS, Delivery


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Intake:
    def __init__(self, redis_client: Any, keys: Keys, consumer: str) -> None:
        self.redis = redis_client
        self.keys = keys
        self.consumer = consumer
        self.streams = {keys.chunks: CHUNKS, keys.requests: REQUESTS}  # parts first: finish started requests

    async def ensure_groups(self) -> bool:
        """Create the group on both streams (and the streams); True if one had to be created."""
        created = False
        for key in self.streams:
            try:
                await self.redis.xgroup_create(key, self.keys.group, id="0", mkstream=True)
                created = True
            except redis.ResponseError as error:
                if "BUSYGROUP" not in str(error):
                    raise
        return created

    async def read(self, count: int, block_ms: int) -> list[Delivery]:
        """New entries (``>``), parts before requests."""
        reply = await self.redis.xreadgroup(self.keys.group, self.consumer, {k: ">" for k in self.streams},
                                            count=count, block=block_ms)
        return [Delivery(self.streams[_text(key)], _text(key), _text(entry_id), fields or {}, 1)
                for key, entries in reply or [] for entry_id, fields in entries]

    async def own_pending(self, count: int) -> list[Delivery]:
        """Entries delivered to this consumer and never acknowledged (a restart, or a reply lost in transit)."""
        out: list[Delivery] = []
        for key, stream in self.streams.items():
            cursor = "0"
            while True:
                reply = await self.redis.xreadgroup(self.keys.group, self.consumer, {key: cursor}, count=count)
                entries = reply[0][1] if reply else []
                if not entries:
                    break
                out += [Delivery(stream, key, _text(i), fields or {}, 0) for i, fields in entries]
                cursor = _text(entries[-1][0])
        await self._counts(out)
        return out

    async def reclaim(self, min_idle_ms: int, count: int) -> tuple[list[Delivery], list[tuple[str, str]]]:
        """Entries idle longer than ``min_idle_ms`` in any consumer's list, now ours; and (stream key, entry id) of
        those that had no payload any more (Redis 7 drops them from the pending list itself)."""
        out: list[Delivery] = []
        gone: list[tuple[str, str]] = []
        for key, stream in self.streams.items():
            cursor = "0-0"
            while True:
                reply = await self.redis.xautoclaim(key, self.keys.group, self.consumer, min_idle_ms,
                                                    start_id=cursor, count=count)
                cursor, entries = _text(reply[0]), reply[1]
                gone += [(key, _text(i)) for i in (reply[2] if len(reply) > 2 else [])]
                out += [Delivery(stream, key, _text(i), fields or {}, 0) for i, fields in entries]
                if cursor == "0-0":
                    break
        await self._counts(out)
        return out, gone

    async def keep_alive(self, deliveries: list[Delivery]) -> None:
        """Reset the idle time of entries still in work so that no one reclaims them (JUSTID: no count bump)."""
        by_key: dict[str, list[str]] = {}
        for d in deliveries:
            by_key.setdefault(d.key, []).append(d.entry_id)
        for key, ids in by_key.items():
            await self.redis.xclaim(key, self.keys.group, self.consumer, 0, ids, justid=True)

    async def claim_again(self, delivery: Delivery) -> Delivery | None:
        """Take an own entry again for a retry: bumps its delivery counter. None if it is gone."""
        reply = await self.redis.xclaim(delivery.key, self.keys.group, self.consumer, 0, [delivery.entry_id])
        if not reply or not reply[0][1]:
            return None
        fresh = Delivery(delivery.stream, delivery.key, delivery.entry_id, reply[0][1], 0)
        await self._counts([fresh])
        return fresh

    async def _counts(self, deliveries: list[Delivery]) -> None:
        """Fill in Redis' delivery counters (reads from history and claims bump them)."""
        if not deliveries:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for d in deliveries:
                pipe.xpending_range(d.key, self.keys.group, d.entry_id, d.entry_id, 1)
            replies = await pipe.execute()
        for d, reply in zip(deliveries, replies):
            d.deliveries = int(reply[0]["times_delivered"]) if reply else 1

    async def group_stats(self) -> dict[str, dict[str, Any]]:
        out = {}
        for key, stream in self.streams.items():
            entry: dict[str, Any] = {"length": await self.redis.xlen(key), "pending": 0, "lag": None}
            for group in await self.redis.xinfo_groups(key):
                if _text(group["name"]) == self.keys.group:
                    entry.update(pending=group["pending"], lag=group.get("lag"))
            out[stream] = entry
        return out
