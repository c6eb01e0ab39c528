"""Results as they land, for callers that hand each on at once (the gateway's streamed batches, its decide):
``wait_any``, a plan of the core (producer/client/plans.py) that both client faces run (``Client.wait_any``,
``AsyncClient.wait_any``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from ..wire.result import Result
from .plans import BLOCK_MS, WINDOW, NotDurable, Plan, Producer, landed, xread


def wait_any(core: Producer, request_ids: Iterable[str], timeout: float) -> Plan[dict[str, Result]]:
    """The results of ``request_ids`` that are there now or, when none is, the first to land within
    ``timeout`` seconds (empty: none did). Call again with the ids still missing.

    Durable mode (``wait_replicas``): a result is returned only once the replicas asked for have it, as
    ``fetch`` and ``wait_many`` do: what the blocking read finds is looked at again with an empty PUBLISH and
    a WAIT (``Producer.present``). One they have not confirmed is not there yet (the wait goes on, each look
    taking up to the WAIT's own 2 s); if none was confirmed by the deadline, the last NotDurable is raised,
    naming them."""
    deadline = time.monotonic() + timeout
    waiting = list(dict.fromkeys(request_ids))
    # One blocking read over every id answers at once with those already there: no look first (a round trip
    # less per call), unless the read cannot cover them all (a cluster, more than a window) or must not block.
    covered = not core.cluster and len(waiting) <= WINDOW and timeout > 0
    done: dict[str, Result] = {}
    shortfall: NotDurable | None = None
    if not covered:
        done, shortfall = yield from _confirmed(core, waiting)
    while not done and waiting and (left := deadline - time.monotonic()) > 0:
        window = {core.keys.result(r): r for r in waiting[: 1 if core.cluster else WINDOW]}
        reply = yield xread(window, max(1, min(BLOCK_MS, int(left * 1000))))
        # ids to look at with a confirmation: those the read found (durable mode), those beyond it
        found, look = landed(reply, window, bool(core.wait_replicas))
        done.update(found)
        if len(waiting) > len(window):  # those beyond the read's window: a look at them too
            look += waiting[len(window):]
        if look:
            found, shortfall = yield from _confirmed(core, look)
            done.update(found)
    if not done and shortfall is not None:
        raise shortfall
    return done


def _confirmed(core: Producer, request_ids: list[str]) -> Plan[tuple[dict[str, Result], NotDurable | None]]:
    """``core.present``: the results there (confirmed, in durable mode), or none and the NotDurable that said so."""
    try:
        return (yield from core.present(request_ids)), None
    except NotDurable as error:
        return {}, error
