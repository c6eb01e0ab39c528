"""A System One call and its retries answered by one request, computed once.

The official clients send no ``Idempotency-Key`` and re-send a ``POST /v1/systemone`` (the same bytes) after a
timeout, a dropped connection, 408, 429 and 5xx: at most three attempts within 30 s, each to whichever gateway
replica the load balancer picks. So the gateway maps each call to a request id in Redis (``Keys.call``, ``SET
NX`` with a TTL, in the model's namespace): the first attempt claims the mapping and enqueues, every later one
finds it and waits for that request's result (still queued or computing: it waits on; answered: the stored
result, with the same ``x-typesafe-request-id``). A call is named by

- its ``Idempotency-Key`` when the client sends one; the same key with another request is refused 422 (the
  IETF idempotency-key draft's status), so a constant key set on a client cannot merge different calls;
- else the queue's digest of the request (producer/wire/digest.py ``digest``: state, questions, images; not
  how it travelled: compression, multipart boundary, key order), so any re-encoding of a retry maps too.

Both are scoped by the caller's tenant (its key's namespace) and the model's name: never shared across tenants
or models. The window is the clients' 30 s retry budget plus the gateway's longest wait for a call
(``--wait-s``; ``--retry-window-s`` to set it). Within it, identical calls of one tenant to one model are
computed once and answered alike: a decision model's answer is a function of its input (deterministic mode
makes that bitwise).

What is registered and when: nothing for a call refused before it is enqueued (401, 403, 404, 413, 415, 422,
429); a submit that certainly did not enqueue (a full queue) drops its claim, so the client's retry enqueues,
and the attempts that found the claim meanwhile see it dropped, their request never queued, and are refused
the same 429 at once (routes.py ``_queued``: they once waited ``--wait-s`` for it, then 504); a Redis error
during the submit keeps it (the request may be queued). A client that hangs up leaves its request queued and
its mapping in place: its retry is on its way.

Cancelling (docs/PROTOCOL.md): a call whose request is cancelled while it waits is answered ``cancelled``,
never sent again behind its caller's back. An attempt that comes after the cancel (the request its mapping
names is cancelled, or a cancel of it was asked, when the attempt finds the mapping) is a new ask: it claims
the next mapping, named by the call and the cancelled id (``after``), so that of several attempts reading it
at once one enqueues and the others wait for that one. A hang-up of a System One call never cancels its
request.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass
from typing import Any

from ...wire.keys import Keys, text

BUDGET_S = 30.0  # the official clients' time for a call and all its retries (typesafe-sdk's RetryPolicy timeout)
CLAIMS = 3  # a mapping read as it expires: claimed again, a few times at most


@dataclass(frozen=True)
class Claim:
    """The request a call maps to: ``fresh`` when this attempt made the mapping (and must enqueue it);
    ``digest``, the digest of the request that made it (for an ``Idempotency-Key`` reused with another
    request)."""

    request_id: str
    fresh: bool
    digest: str


def call_of(tenant: str, model: str, digest: str, key: str | None) -> str:
    """The name of a call: its tenant, model, and Idempotency-Key or request digest."""
    named = ("key", key) if key is not None else ("digest", digest)
    return hashlib.sha256("\0".join(("systemone", tenant, model, *named)).encode()).hexdigest()[:32]


def after(call: str, cancelled: str) -> str:
    """The next name of a call whose request was cancelled: the same for every attempt that read that."""
    return hashlib.sha256(f"{call}\0{cancelled}".encode()).hexdigest()[:32]


class Retries:
    """Claims made in one turn of the event loop go to Redis together, one pipeline of ``SET NX``, not a round
    trip each: under load a call's own Redis command was most of what the route added to a decide. Only a
    claim that finds a mapping (a retry, an identical call) reads it, on its own."""

    def __init__(self, connection: Any, window_s: float) -> None:
        self.connection, self.window_ms = connection, max(1, int(window_s * 1000))
        self.waiting: list[tuple[str, str, asyncio.Future[Any]]] = []

    async def claim(self, namespace: str, call: str, request_id: str, digest: str) -> Claim:
        """Map ``call`` to ``request_id`` unless it maps to a request already."""
        key, value = Keys(namespace).call(call), f"{request_id} {digest}"
        for _ in range(CLAIMS):
            future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            if not self.waiting:
                asyncio.get_running_loop().call_soon(self._flush)
            self.waiting.append((key, value, future))
            if await future:
                return Claim(request_id, True, digest)
            found = await self.connection().get(key)
            if found is not None:  # else it expired between the two commands: claim again
                mapped, _, mapped_digest = text(found).partition(" ")
                return Claim(mapped, False, mapped_digest)
        return Claim(request_id, True, digest)  # not mapped: this attempt's own request

    def _flush(self) -> None:
        batch, self.waiting = self.waiting, []
        asyncio.ensure_future(self._send(batch))

    async def _send(self, batch: list[tuple[str, str, asyncio.Future[Any]]]) -> None:
        try:
            async with self.connection().pipeline(transaction=False) as pipe:
                for key, value, _ in batch:
                    pipe.set(key, value, nx=True, px=self.window_ms)
                replies = await pipe.execute(raise_on_error=False)  # each claim its own reply, or its error
        except Exception as error:  # noqa: BLE001 - every claim of the turn sees what its own command would raise
            for *_, future in batch:
                if not future.done():  # a caller that went away cancelled its future
                    future.set_exception(error)
            return
        for (*_, future), made in zip(batch, replies):
            if not future.done():
                future.set_exception(made) if isinstance(made, Exception) else future.set_result(made)

    async def maps(self, namespace: str, call: str, request_id: str) -> bool:
        """Whether ``call`` still maps to ``request_id`` (a claim dropped after a full queue does not)."""
        found = await self.connection().get(Keys(namespace).call(call))
        return found is not None and text(found).partition(" ")[0] == request_id

    async def forget(self, namespace: str, call: str) -> None:
        """Drop a call's mapping: its submit certainly failed, or its request was cancelled."""
        await self.connection().delete(Keys(namespace).call(call))
