"""Results as they land, for callers that hand each on at once (the gateway's streamed batches, its decide):
``wait_any``, a plan of the core (producer/core.py) that both client faces run (``Client.wait_any``,
``AsyncClient.wait_any``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from .core import BLOCK_MS, WINDOW, Call, Plan, Producer, parse_result
from .result import Result


def wait_any(core: Producer, request_ids: Iterable[str], timeout: float) -> Plan[dict[str, Result]]:
    """The results of ``request_ids`` that are there now or, when none is, the first to land within ``timeout``
    seconds (empty: none did). Call again with the ids still missing."""
    deadline = time.monotonic() + timeout
    waiting = list(dict.fromkeys(request_ids))
    # One blocking read over every id answers at once with those already there: no look first (a round trip less
    # per call), unless the read cannot cover them all (a cluster, more than a window) or must not block.
    covered = not core.cluster and len(waiting) <= WINDOW and timeout > 0
    done = {} if covered else (yield from core.present(waiting))
    while not done and waiting and (left := deadline - time.monotonic()) > 0:
        window = {core.keys.result(r): r for r in waiting[: 1 if core.cluster else WINDOW]}
        reply = yield Call("xread", (dict.fromkeys(window, "0-0"),),
                           {"count": 1, "block": max(1, min(BLOCK_MS, int(left * 1000)))})
        for key, entries in reply or []:
            request_id = window[key.decode() if isinstance(key, bytes) else key]
            done[request_id] = parse_result(entries[0][1], request_id)
        if len(waiting) > len(window):  # those beyond the read's window: a look at them too
            done.update((yield from core.present(waiting[len(window):])))
    return done
