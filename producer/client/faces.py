"""The client's two faces: submit requests, wait for their results, cancel them, ask where they are, read
queue stats; blocking (``Client``) or asyncio (``AsyncClient``), with the same methods.

Both faces run the plans of one core (``plans.Producer``) against their connection: the logic is written once,
only the I/O differs (runner.py, where ``Face`` says what the constructor takes).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..wire.result import Result
from . import arrivals, stats
from .plans import Submittable
from .runner import Asynchronous, Blocking


class Client(Blocking):
    """The blocking producer."""

    def submit(self, request: Submittable) -> str:
        """Enqueue one request; returns its id. Raises InvalidRequest (nothing sent) or QueueFull."""
        return self.submit_many([request])[0]

    def submit_many(self, requests: Iterable[Submittable]) -> list[str]:
        """Enqueue requests in batches, each all or nothing; returns their ids in order. On backpressure
        raises QueueFull, whose ``accepted`` and ``refused`` say which went in."""
        return self._run(self.core.submit_many(requests))

    def fetch(self, request_id: str) -> Result | None:
        """The result if it is there (non-blocking)."""
        return self._run(self.core.fetch(request_id))

    def wait(self, request_id: str, timeout: float | None = 60.0) -> Result:
        """The result of one request, blocking up to ``timeout`` seconds (None: forever); raises ResultTimeout."""
        return self.wait_many([request_id], timeout)[request_id]

    def wait_many(self, request_ids: Iterable[str], timeout: float | None = 60.0, *, check: bool = True
                  ) -> dict[str, Result]:
        """Results of all ``request_ids`` by id, in their order; raises ResultTimeout naming how many are
        missing. A result of another request under an id this client submitted is returned as ``id_conflict``;
        ``check`` False: every result as stored (for a reader that compares each with its own request's
        digest)."""
        return self._run(self.core.wait_many(request_ids, timeout, check))

    def wait_any(self, request_ids: Iterable[str], timeout: float = 1.0) -> dict[str, Result]:
        """Those of the results that are there; when none is, the first to land within ``timeout`` seconds
        (empty: none did). Results as they land: call again with the ids still missing."""
        return self._run(arrivals.wait_any(self.core, request_ids, timeout))

    def decide(self, request: Submittable, timeout: float | None = 60.0) -> Result:
        """Submit and wait."""
        return self._run(self.core.decide(request, timeout))

    def stats(self) -> dict[str, Any]:
        """Queue totals and per-shard figures (``stats.stats`` says what each is)."""
        return self._run(stats.stats(self.core))

    def live_workers(self) -> int | None:
        """Live workers of the namespace (a heartbeat in the last 30 s); None when the user may not look."""
        return self._run(self.core.live_workers())

    def close(self) -> None:  # a given connection is its owner's to close
        if not self._given:
            self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(Asynchronous):
    """The asyncio producer: ``Client``'s methods, awaited."""


    async def submit(self, request: Submittable) -> str:
        return (await self.submit_many([request]))[0]

    async def submit_many(self, requests: Iterable[Submittable]) -> list[str]:
        return await self._run(self.core.submit_many(requests))

    async def fetch(self, request_id: str) -> Result | None:
        return await self._run(self.core.fetch(request_id))

    async def wait(self, request_id: str, timeout: float | None = 60.0) -> Result:
        return (await self.wait_many([request_id], timeout))[request_id]

    async def wait_many(self, request_ids: Iterable[str], timeout: float | None = 60.0, *, check: bool = True
                        ) -> dict[str, Result]:
        return await self._run(self.core.wait_many(request_ids, timeout, check))

    async def wait_any(self, request_ids: Iterable[str], timeout: float = 1.0) -> dict[str, Result]:
        return await self._run(arrivals.wait_any(self.core, request_ids, timeout))

    async def decide(self, request: Submittable, timeout: float | None = 60.0) -> Result:
        return await self._run(self.core.decide(request, timeout))

    async def stats(self) -> dict[str, Any]:
        return await self._run(stats.stats(self.core))

    async def live_workers(self) -> int | None:
        return await self._run(self.core.live_workers())

    async def close(self) -> None:  # a given connection is its owner's; the client of its own is closed
        if not self._given:
            await self.redis.aclose()
        if self._once is not None:
            await self._once.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
