"""The entries this worker holds, on the Redis loop thread: each held once however it arrived (read,
recovered, reclaimed, retried), with its state (one field, set at each step of its life), room for
``--max-inflight`` of them per lane, and what was let go or lost lately. Other threads read only its length
and ``oldest_taken`` (health, the drain).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass

from producer.wire.keys import LANES, Priority

from ..entries import Delivery
from ..metrics import Metrics
from ..tasks import State, Task

# Remembered lately: payload-less entries (each counted once), entries let go (a read begun before takes none
# again)
LOST_REMEMBERED = RELEASED_REMEMBERED = 10_000
Entry = tuple[str, str]  # (stream key, entry id): entry ids are unique per stream only


@dataclass(eq=False)
class Held:
    """One held entry: the delivery as taken, its state, and its task once planned."""

    delivery: Delivery
    state: State = State.TAKEN
    task: Task | None = None
    cancelled: bool = False  # answered ``cancelled``

    @property
    def request_id(self) -> str:  # the body's, once planned (a delivery of a request entry may not know it)
        return self.task.request_id if self.task is not None else self.delivery.request_id


class HeldEntries:
    """Held entries in the order they were taken."""

    def __init__(self, max_inflight: int, metrics: Metrics) -> None:
        self.max_inflight, self.metrics = max_inflight, metrics
        self.entries: dict[Entry, Held] = {}
        # request id -> its held entries (cancels find them)
        self.by_request: dict[str, dict[Entry, None]] = {}
        self.held_in = dict.fromkeys(LANES, 0)
        self.room = {lane: asyncio.Event() for lane in LANES}  # set when an entry of the lane is let go
        self.lost: dict[Entry, None] = {}  # counted as lost, recent ones
        self.released: dict[Entry, float] = {}  # -> when let go (monotonic), recent ones
        self.released_at: float | None = None  # when an entry was last let go (health; burst runs)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, entry: object) -> bool:
        return entry in self.entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    def deliveries(self) -> list[Delivery]:
        return [held.delivery for held in self.entries.values()]

    def get(self, entry: Entry) -> Held | None:
        return self.entries.get(entry)

    def of_request(self, request_id: str) -> list[Held]:
        return [self.entries[entry] for entry in self.by_request.get(request_id, ())]

    def _index(self, held: Held, add: bool) -> None:
        entry = (held.delivery.key, held.delivery.entry_id)
        if add:
            self.by_request.setdefault(held.request_id, {})[entry] = None
        elif (entries := self.by_request.get(held.request_id)) is not None:
            entries.pop(entry, None)
            if not entries:
                del self.by_request[held.request_id]

    def move(self, delivery: Delivery, state: State, task: Task | None = None) -> None:
        """The entry's next state (and its task, once planned), while this delivery of it is held: not once a
        stop past its deadline let it go, nor after a retry took it again under a new delivery."""
        held = self.entries.get((delivery.key, delivery.entry_id))
        if held is not None and held.delivery is delivery:
            held.state = state
            if task is not None:  # indexed under the request id its body names from now on
                self._index(held, add=False)
                held.task = task
                self._index(held, add=True)

    def hold(self, delivery: Delivery, how: str, since: float | None) -> bool:
        """Hold an entry, counted, unless it is held already or was let go ``since`` the call that found
        it."""
        if self.known((delivery.key, delivery.entry_id), since):
            return False
        self.entries[delivery.key, delivery.entry_id] = held = Held(delivery)
        self._index(held, add=True)
        self.held_in[delivery.lane] += 1
        metrics = self.metrics
        metrics.inflight.set(len(self.entries))
        metrics.entries.labels(delivery.stream, how).inc()
        metrics.entries_ahead.labels(delivery.stream).inc(int(delivery.ahead))
        if delivery.deliveries > 1:
            metrics.redeliveries.labels(delivery.stream).inc()
        else:
            waited = max(0.0, delivery.taken - delivery.enqueued_ms / 1000)
            metrics.queue_wait.labels(delivery.lane).observe(waited)
        return True

    def known(self, entry: Entry, since: float | None) -> bool:  # held now, or let go since ``since``
        return entry in self.entries or (since is not None and self.released.get(entry, float("-inf")) >= since)

    def release(self, delivery: Delivery) -> None:
        """Let the entry go (settled, fanned out, or acknowledged alone)."""
        entry = (delivery.key, delivery.entry_id)
        if (held := self.entries.pop(entry, None)) is not None:
            self._index(held, add=False)
            self.held_in[delivery.lane] -= 1
            self.room[delivery.lane].set()
            self.released[entry] = time.monotonic()
            self.released_at = time.time()
            while len(self.released) > RELEASED_REMEMBERED:
                del self.released[next(iter(self.released))]
        self.metrics.inflight.set(len(self.entries))

    def room_in(self, lane: Priority) -> int:  # how many more entries of the lane may be taken
        return self.max_inflight - self.held_in[lane]

    def oldest_taken(self) -> float | None:
        """When the longest-held entry was taken. Any thread: the loop thread may change the entries
        meanwhile."""
        for _ in range(3):
            try:
                return next(iter(self.entries.values())).delivery.taken if self.entries else None
            except (RuntimeError, StopIteration):
                continue
        return None

    def count_lost(self, entries: list[Entry]) -> int:
        """Count payload-less pending entries once each (a reclaim and an ack may both see one in the
        list)."""
        fresh = [entry for entry in entries if entry not in self.lost]
        self.lost.update(dict.fromkeys(fresh))
        while len(self.lost) > LOST_REMEMBERED:
            del self.lost[next(iter(self.lost))]
        self.metrics.lost.inc(len(fresh))
        return len(fresh)
