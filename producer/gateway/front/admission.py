"""Admission: what a keyed call gets before a byte of its body is read, and its body, read within limits. The
front layer (front.py) admits every keyed call, whatever its route, so a route added later is bounded the same
way:

- one of its key's in-flight slots (429 beyond the key's ``max_inflight``); a call of several requests takes
  the rest once its body is parsed (``more``: 413 for more than the key ever allows, 429 while too many are in
  flight);
- its share of the bodies held at once over every caller (``--max-body-bytes-in-flight``): its declared
  length, else the whole ``--max-body-bytes``; beyond, 503 ``busy`` with ``Retry-After``, the body unread.
  One key sending forty 7 MB bodies took the gateway to 800 MB, though 24 of the calls were then refused
  429. A route that inflates a compressed body ``grow``s the share before each step (System One:
  decoding.py), and one that has parsed its body ``hold``s what it keeps for the rest of the call;
- its body within ``--max-body-bytes`` (413 on the declared length, or as soon as the bytes read pass it),
  with no pause over ``--body-timeout-s`` between its parts (408, the connection closed).

What a call holds comes back when it ends, however it ends (``leave``: the front layer calls it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.types import Message, Receive

from .access import Access, Inflight
from .replies import RETRY_AFTER_S, Refused

CLOSE = {"Connection": "close"}  # a refusal before its body was read: the rest of the body is not read either


class Admission:
    """What the calls in flight hold (in-flight slots, the body budget), taken before a body is read."""

    def __init__(self, inflight: Inflight, max_body_bytes: int, budget: int, body_timeout_s: float) -> None:
        self.inflight, self.max_body_bytes = inflight, max_body_bytes
        self.budget, self.body_timeout_s = budget, body_timeout_s
        self.reading = 0  # body bytes the calls in flight hold (declared, the limit for a streamed one, inflated)

    @property
    def exhausted(self) -> bool:
        """No room for one more body of the largest size (readiness)."""
        return self.reading + self.max_body_bytes > self.budget

    def enter(self, state: dict[str, Any], access: Access, declared: int | None, body: bool) -> None:
        """One slot of ``access``'s, and with a ``body`` its share of the budget; raises Refused (nothing held)."""
        if declared is not None and declared > self.max_body_bytes:
            raise Refused(413, "body_too_large", f"the body is over the {self.max_body_bytes}-byte limit",
                          headers=CLOSE)
        share = (self.max_body_bytes if declared is None else declared) if body else 0
        if share and self.reading + share > self.budget:
            raise Refused(503, "busy", "the gateway is reading as many bodies as it may at once; retry",
                          headers={"Retry-After": str(RETRY_AFTER_S), **CLOSE})
        if not self.inflight.take(access, 1):
            raise Refused(429, "too_many_in_flight", f"this API key has {access.max_inflight} requests being "
                          "answered at most; wait for some", headers={"Retry-After": str(RETRY_AFTER_S), **CLOSE})
        state["held"] = [(access.name, 1)]
        self.reading += share
        state["share"] = share

    def grow(self, state: dict[str, Any], more: int) -> None:
        """``more`` bytes on the call's share, before they are made (a compressed body inflating); 503 busy,
        its share as it was, where the budget has no room."""
        if self.reading + more > self.budget:
            raise Refused(503, "busy", "the gateway holds as many bodies as it may at once (a compressed body "
                          "counts what it inflates to); retry", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.reading += more
        state["share"] = state.get("share", 0) + more

    def hold(self, state: dict[str, Any], held: int) -> None:
        """The call's share becomes what it holds now (``held`` bytes: its body parsed and serialized once,
        what it read and inflated dropped): given back where less, ``grow``n (maybe refused) where more."""
        share = state.get("share", 0)
        if held > share:
            self.grow(state, held - share)
        else:
            self.reading -= share - held
            state["share"] = held

    def more(self, http: HttpRequest, count: int) -> None:
        """``count`` slots in all for the call (it holds one): 413 for more than its key ever allows (waiting
        would not help), 429 while too many are in flight."""
        access: Access = http.state.access
        if count > access.max_inflight:
            raise Refused(413, "batch_too_large", f"{count} requests, over this API key's limit of "
                          f"{access.max_inflight} in flight: it can never be admitted; split it", "requests")
        if count > 1:
            if not self.inflight.take(access, count - 1):
                raise Refused(429, "too_many_in_flight", f"this API key has {access.max_inflight} requests being "
                              "answered at most; wait for some", headers={"Retry-After": str(RETRY_AFTER_S)})
            http.state.held = [*http.state.held, (access.name, count - 1)]

    def leave(self, state: dict[str, Any]) -> None:
        """Give back what the call holds (once: the front layer may call it twice)."""
        for name, count in state.pop("held", ()):
            self.inflight.give_back(name, count)
        self.reading -= state.pop("share", 0)

    def receiving(self, receive: Receive, state: dict[str, Any]) -> Receive:
        """``receive`` that refuses a body once it passes the limit (413) or pauses too long (408);
        afterwards, as it is (a wait for the caller's disconnect has no time limit). A disconnect is noted in
        ``state["gone"]``."""
        seen, done = [0], [False]

        async def received() -> Message:
            if done[0]:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), self.body_timeout_s)
                except asyncio.TimeoutError:
                    raise HTTPException(408, {"code": "body_timeout", "message": f"no part of the body came within "
                                              f"{self.body_timeout_s:g} s"}, headers=CLOSE) from None
            if message["type"] == "http.request":
                seen[0] += len(message.get("body", b""))
                if seen[0] > self.max_body_bytes:
                    raise HTTPException(413, {"code": "body_too_large", "message": f"the body is over the "
                                              f"{self.max_body_bytes}-byte limit"}, headers=CLOSE)
                done[0] = not message.get("more_body", False)
            elif message["type"] == "http.disconnect":
                done[0] = state["gone"] = True
            return message

        return received
