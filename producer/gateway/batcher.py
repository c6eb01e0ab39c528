"""Submissions of concurrent calls, sent together: every call that submits in the same turn of the event loop
joins one ``submit_many`` (one submit-function call per shard and lane, up to the client's batch), instead of
one round trip each. Under load most of a call's cost was its own Redis command; coalesced, a gateway process
answers several times the calls per second (docs/BENCHMARKS.md), and a lone call waits one turn of the loop
(microseconds).

Each call keeps its own outcome: its requests went in, or ``QueueFull`` naming which of *its* ids went in and
which did not (a batch is all or nothing, so callers whose requests rode in one refused batch are all refused,
as one caller's batch would be). Any other error is every joined call's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from ..client import AsyncClient
from ..client.plans import BATCH, Prepared, QueueFull


class Batcher:
    """One per client (namespace)."""

    def __init__(self, client: AsyncClient, most: int = BATCH) -> None:
        self.client, self.most = client, most
        self.waiting: list[tuple[list[Prepared], asyncio.Future[None]]] = []
        self.size = 0

    async def submit(self, prepared: Sequence[Prepared]) -> None:
        """Send ``prepared`` with whatever else is submitted in this turn; raises as a lone ``submit_many`` would."""
        if self.size and self.size + len(prepared) > self.most:
            self._flush()  # full: go now, this call starts the next one
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not self.waiting:
            asyncio.get_running_loop().call_soon(self._flush)
        self.waiting.append((list(prepared), future))
        self.size += len(prepared)
        await future

    def _flush(self) -> None:
        if self.waiting:
            calls, self.waiting, self.size = self.waiting, [], 0
            asyncio.ensure_future(self._send(calls))

    async def _send(self, calls: list[tuple[list[Prepared], asyncio.Future[None]]]) -> None:
        try:
            await self.client.submit_many([item for prepared, _ in calls for item in prepared])
        except QueueFull as full:
            went = set(full.accepted)
            for prepared, future in calls:
                ids = [p.id for p in prepared]
                if all(i in went for i in ids):
                    _settle(future)
                else:
                    _settle(future, QueueFull(full.detail, [i for i in ids if i in went],
                                              [i for i in ids if i not in went]))
        except Exception as error:  # noqa: BLE001 - every joined call sees what its own call would have raised
            for _, future in calls:
                _settle(future, error)
        else:
            for _, future in calls:
                _settle(future)


def _settle(future: asyncio.Future[None], error: BaseException | None = None) -> None:
    if not future.done():  # a caller that went away cancelled its future
        future.set_exception(error) if error is not None else future.set_result(None)
