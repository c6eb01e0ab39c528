"""Whether the server has the function library (producer/wire/library.py), without which nothing can be
published: loaded when missing or older (where this worker's user may), said loudly while it is not, and read
by readiness (``ok``). Looked for every 5 s while missing, every 30 s while there: a server restarted empty
has none, and the worker turns unready within that time, not at its next result."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import redis

from producer.plumbing import library_loader
from producer.wire import library

from .redis_calls import REDIS_ERRORS

log = logging.getLogger("worker")


class LibraryWatch:
    """Whether the server has the function library, loading it where it may."""

    def __init__(self, redis_client: Any) -> None:
        self.redis = redis_client
        self.ok = False
        self.logged = float("-inf")
        self._checking: asyncio.Future[bool] | None = None

    async def check(self) -> bool:
        """Whether the library is loaded, loading it if the server lacks it or has an older revision."""
        try:
            loaded = await library_loader.aensure(self.redis)
        except REDIS_ERRORS:  # Redis down: RedisCalls reports that
            self.ok = False
            return False
        except (library.LibraryUnavailable, redis.ResponseError) as error:  # or NOPERM on the check itself
            self.ok = False
            if time.monotonic() - self.logged > 30:
                self.logged = time.monotonic()
                log.error("%s; unready: nothing can be published until the library is loaded", error)
            return False
        if loaded.action != "present":
            log.info("function library %s revision %d %s", library.LIBRARY, loaded.revision, loaded.action)
        self.ok = True
        return True

    async def recheck(self) -> bool:
        """``check`` once for every caller meanwhile (each outcome a server without the library refused)."""
        if self._checking is None or self._checking.done():
            self._checking = asyncio.ensure_future(self.check())
        return await asyncio.shield(self._checking)

    async def watch(self) -> None:
        """Until cancelled: ``check`` every 5 s while the library is missing, every 30 s while it is there."""
        while True:
            await asyncio.sleep(30.0 if await self.check() else 5.0)
