"""A worker's presence on its shard: its heartbeat, and forgetting the workers and consumers that are gone, so
that ``python -m producer stats`` and the dashboards count the living only.

- Heartbeat: every maintenance round (5 s) a worker writes ``{ts, inflight, model, models, engine, shard,
  state}`` under its consumer name in ``Keys.workers`` (``state``: warming, ready or draining; ``dq-producer
  stats`` lists them; the gateway routes System One calls by ``models``). A beat older than ``GONE_S``
  (producer/wire/keys.py) is a worker that is gone: Redis 7.0 has no per-field expiry, so any live worker
  deletes such beats, and stats never count them.
- Consumers: the group keeps a consumer after its worker died (a restart under a new name, a KEDA scale-down).
  One with nothing pending that has been idle longer than ``--consumer-gone-ms`` is deleted, by a function of
  the library (producer/wire/library.py) that checks and deletes in one step: a consumer given an entry in
  between keeps it (deleting a consumer drops its pending list, and entries only it held would never be
  reclaimed). Consumers holding entries stay until another worker reclaims them (``--claim-idle-ms``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from producer.wire import library
from producer.wire.keys import GONE_S, Keys, beat_age, text


class Presence:
    """This worker's heartbeat on its shard, and forgetting the workers and consumers gone."""

    def __init__(self, redis_client: Any, keys: Keys, name: str, streams: list[str], gone_ms: int,
                 identity: dict[str, Any], state: Callable[[], str] = lambda: "ready") -> None:
        self.redis, self.keys, self.name, self.streams = redis_client, keys, name, streams
        self.gone_ms = gone_ms
        # model (the name results say), models (every name it serves under), engine, shard
        self.identity = identity
        self.state = state
        self.written = False  # a heartbeat of this worker is on the server: producers can route to it by model

    async def beat(self, inflight: int) -> None:
        beat = {"ts": time.time(), "inflight": inflight, **self.identity, "state": self.state()}
        await self.redis.hset(self.keys.workers(), self.name, json.dumps(beat))
        self.written = True

    async def forget_the_gone(self) -> tuple[list[str], list[str]]:
        """Delete dead consumers (nothing pending, idle past the limit) and stale heartbeats; both lists of
        names."""
        consumers: list[str] = []
        for key in self.streams:
            consumers += [text(name) for name in
                          await self.redis.fcall(library.FORGET, 1, key, self.keys.group,
                                                 self.gone_ms, self.name)]
        now = time.time()
        beats = await self.redis.hgetall(self.keys.workers())
        stale = [name for name, raw in beats.items()
                 if beat_age(raw, now) > GONE_S and text(name) != self.name]
        if stale:
            await self.redis.hdel(self.keys.workers(), *stale)
        return sorted(set(consumers)), sorted(text(name) for name in stale)

    async def leave(self) -> None:
        """Take this worker's heartbeat out (a clean stop)."""
        await self.redis.hdel(self.keys.workers(), self.name)
