"""Prompts -> packs: fill one forward pass up to the token budget, high-priority work first, waiting at most
``max_wait`` for more work.

How much a pack takes depends on whether the GPU is idle. Idle (``next()``): everything queued, up to the budget:
nothing else would run meanwhile, and the smallest static size (CUDA graph bucket) that holds it pads it. Busy
(``next(behind=n)``, while a pack of n tokens runs): only a pack that fills a static size, the largest that what is
queued fills, or nothing: then the GPU thread reads out the pack on the GPU first, and what arrives meanwhile joins
the next pack. So packs grow with the backlog rather than to the budget: under moderate load a request waits for
one small pack, and only a backlog makes full-budget packs (the peak). A padded size would cost the GPU the time of
tokens nobody sent; a full one launched behind the running pack keeps the GPU busy.

Each lane's prompts wait in arrival order. A pack takes the high lane's first, then the normal lane's, first fit over a
short window of each: a prompt that does not fit is passed over for smaller later ones, and waits at the front of its
lane for a later pack.

Normal work is never starved. While some waits, every pack owes it ``normal_share`` of the pack's budget, and high
work leaves that much room (the oldest high prompt still opens the pack whatever its size). What normal work was owed
and could not use (its oldest prompt did not fit) is carried to the next pack, up to a whole budget: a long normal
prompt gets in once enough is owed, and then opens the pack.

While high work flows (some was queued in the last ``HIGH_RECENT_S``), packs are held to ``high_budget`` tokens: a
high request waits behind the packs already on the GPU, and smaller packs bound that wait.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from producer.wire.keys import HIGH, LANES, NORMAL, Priority

from ..tasks import Item, Task

HOLD = 64  # prompts of a lane looked at per step (first fit), oldest first
HIGH_RECENT_S = 1.0  # packs stay at high_budget this long after high work was last queued
HIGH_IN_USE_S = 300.0  # the high lane counts as in use this long after high work was last queued
FULL = 0.9  # a pack this full of its static size counts as full


class Packer:
    """The queue of prompts waiting for the GPU, formed into packs by lane and budget."""

    def __init__(self, budget: int, max_wait: float, normal_share: float = 0.1, high_budget: int = 0,
                 sizes: tuple[int, ...] = ()) -> None:
        """``sizes``: the static sizes a pack is padded to (the engine's CUDA graph buckets); none: a pack costs
        its real tokens, and only the budget counts as a size."""
        self.full_budget = budget
        self.high_budget = min(high_budget, budget) if high_budget > 0 else budget
        self.max_wait = max_wait
        self.normal_share = normal_share
        self.sizes = tuple(sorted(sizes))
        self.budget = budget  # the budget of the last pack formed
        self.lanes: dict[Priority, deque[Item]] = {lane: deque() for lane in LANES}
        self.tokens = {lane: 0 for lane in LANES}  # queued, per lane
        self.owed = 0  # tokens of pack room normal work is owed and has not had yet
        self.high_seen = float("-inf")  # when high work was last queued (monotonic)
        self.ready = threading.Condition()

    def put(self, items: list[Item]) -> None:
        """Queue a task's prompts in their lane (any thread), at once: a pack formed meanwhile sees all or none."""
        with self.ready:
            for item in items:
                self.lanes[item.lane].append(item)
                self.tokens[item.lane] += item.tokens
                if item.lane == HIGH:
                    self.high_seen = time.monotonic()
            self.ready.notify()

    def withdraw(self, task: Task) -> bool:
        """Take every prompt of ``task`` out (any thread), if none of them has left for a pack yet: True; else leave
        them all (its answers come as usual) and False. Under the lock ``next`` takes packs under, so a prompt is
        either withdrawn here or packed there, never both."""
        with self.ready:
            queued = [item for item in self.lanes[task.delivery.lane] if item.task is task]
            if len(queued) != len(task.prompts):
                return False
            lane = self.lanes[task.delivery.lane]
            kept = [item for item in lane if item.task is not task]
            lane.clear()
            lane.extend(kept)
            self.tokens[task.delivery.lane] -= sum(item.tokens for item in queued)
            return True

    def next(self, timeout: float = 0.25, wait: bool = True, behind: int = 0) -> list[Item]:
        """The next pack (possibly empty after ``timeout`` with no work). ``wait=False``: take what is there.
        ``behind`` (the tokens of the pack running on the GPU): a pack that fills a static size, or none, at once.
        While the high lane is in use, behind a pack over the high budget at most the high budget: the first high
        request after a spell of normal work waits for the running pack and a small one, not two full ones (a
        worker without high work never pays what the smaller packs cost: 2.9% of the peak on an H100,
        docs/BENCHMARKS.md, "Latency a caller feels")."""
        with self.ready:
            if behind:
                self.budget = self._budget_now()
                in_use = time.monotonic() - self.high_seen < HIGH_IN_USE_S
                size = self._filled_size(self.high_budget if in_use and behind > self.high_budget else self.budget)
                return self._full(size) if size else []
            if not (self.ready.wait_for(self._queued, timeout) if wait else self._queued()):
                return []
            if wait:  # the latency bound runs from the first prompt: a partly filled pack waits at most max_wait
                self.ready.wait_for(lambda: sum(self.tokens.values()) >= self._budget_now(), self.max_wait)
            self.budget = self._budget_now()
            return self._fill(self.budget)

    def _full(self, size: int) -> list[Item]:
        """A pack filled to ``size`` that fills its static size (``FULL``), else none and the queue as it was: what
        is queued may not pack that well (prompts that do not fit together, a long one in front)."""
        lanes, tokens, owed = {lane: deque(queue) for lane, queue in self.lanes.items()}, dict(self.tokens), self.owed
        pack = self._fill(size)
        got = self._tokens(pack)
        static = next((each for each in self.sizes if each >= got), None) if self.sizes else size
        if static is None or got >= FULL * static:  # a prompt over every size runs alone, eagerly, whatever its fill
            return pack
        self.lanes, self.tokens, self.owed = lanes, tokens, owed
        return []

    def _filled_size(self, budget: int) -> int:
        """The largest static size up to ``budget`` that what is queued fills (``FULL``), else 0."""
        queued = sum(self.tokens.values())
        sizes = [size for size in self.sizes if size < budget] + [budget]
        return max((size for size in sizes if queued >= FULL * size), default=0)

    def _queued(self) -> bool:
        return any(self.lanes.values())

    def _budget_now(self) -> int:
        high = self.lanes[HIGH] or time.monotonic() - self.high_seen < HIGH_RECENT_S
        return self.high_budget if high else self.full_budget

    def _fill(self, budget: int) -> list[Item]:
        """High first, leaving normal work the room it is owed; then normal; then either, first fit, in what is
        left."""
        high, normal = self.lanes[HIGH], self.lanes[NORMAL]
        self.owed = min(self.owed + math.ceil(self.normal_share * budget), budget) if normal else 0
        pack: list[Item] = []
        if high and self.owed < budget:  # the oldest high prompt opens the pack, unless normal is owed all of it
            self._move(HIGH, high.popleft(), pack)
        self._first_fit(HIGH, pack, budget - self.owed)
        got = 0  # normal tokens in the pack
        while normal and got < self.owed and (not pack or self._tokens(pack) + normal[0].tokens <= budget):
            got += normal[0].tokens  # oldest first: a long prompt is not passed over for good
            self._move(NORMAL, normal.popleft(), pack)
        self._first_fit(HIGH, pack, budget)
        self._first_fit(NORMAL, pack, budget)
        got = sum(item.tokens for item in pack if item.lane == NORMAL)
        self.owed = max(0, self.owed - got) if normal else 0
        return pack

    def _first_fit(self, lane: Priority, pack: list[Item], limit: int) -> None:
        """Move the lane's prompts that fit under ``limit`` tokens into ``pack``, oldest first; the rest keep their
        place."""
        queue, passed = self.lanes[lane], []
        used = self._tokens(pack)
        for _ in range(min(HOLD, len(queue))):
            if used >= limit:
                break
            item = queue.popleft()
            if used + item.tokens <= limit:
                self._move(lane, item, pack)
                used += item.tokens
            else:
                passed.append(item)
        queue.extendleft(reversed(passed))

    def _move(self, lane: Priority, item: Item, pack: list[Item]) -> None:
        pack.append(item)
        self.tokens[lane] -= item.tokens

    @staticmethod
    def _tokens(pack: list[Item]) -> int:
        return sum(item.tokens for item in pack)
