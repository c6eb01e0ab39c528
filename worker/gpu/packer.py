"""Prompts -> packs: each pack of the size the pack policy gives (worker/gpu/policy.py), high-priority work
first, launched while the GPU is idle at once and behind a running pack just before it ends.

Idle (``next()``): a pack of what is queued, at once (``max_wait`` lets a partly filled one wait for company).
Busy (``next(behind=True)``, while a pack runs): the next pack is formed just before the running one is
expected to end (``Policy.lead``: its launch's host time and a margin ahead),
from everything that arrived by then, so that the GPU runs back to back and a request arriving meanwhile rides
in the next pack rather than the one after. A pack of the largest size may go sooner, but never so soon that a
high request arriving just after it would miss its target (it waits for both packs on the GPU). If nothing is
queued by then, or the running pack is done already, none: the GPU thread reads the running pack out first.

Each lane's prompts wait in arrival order. A pack takes the high lane's first, then the normal lane's, first
fit: a prompt that does not fit is passed over (up to ``HOLD`` of them) for smaller later ones, and waits at
the front of its lane for a later pack.

Normal work is never starved. While some waits, every pack owes it ``normal_share`` of the pack's size, and
high work leaves that much room (the oldest high prompt still opens the pack whatever its size). What normal
work was owed and could not use (its oldest prompt did not fit) is carried to the next pack, up to a whole
pack: a long normal prompt gets in once enough is owed, and then opens the pack.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from producer.wire.keys import HIGH, LANES, NORMAL, Priority

from ..model.engine import Pending
from ..tasks import Item, Task
from .policy import FULL, Clock, Policy, Waiting

HOLD = 64  # prompts of a lane passed over per step (first fit), oldest first
POLL_S = 0.002  # while waiting for the moment behind a running pack, whether it is done is looked at this often


@dataclass
class Running:
    """A pack launched and not read out yet: its size, and when it is expected to start and end on the GPU."""

    pending: Pending
    size: int
    launched_at: float
    starts_at: float  # when the pack before it ends, else at its launch
    ends_at: float


class Packer:
    """The queue of prompts waiting for the GPU, formed into packs by lane and by the pack policy."""

    def __init__(self, budget: int, max_wait: float, normal_share: float = 0.1, sizes: tuple[int, ...] = (),
                 high_target: float = 0.1, clock: Clock | None = None) -> None:
        """``sizes``: the static sizes a pack is padded to (the engine's CUDA graph buckets); none: a pack
        costs its real tokens. ``high_target``: seconds a high-priority request should take from taken to read
        out."""
        self.budget = budget
        self.max_wait = max_wait
        self.normal_share = normal_share
        self.sizes = tuple(sorted(sizes))
        self.policy = Policy(budget, self.sizes, high_target)
        self.clock = clock or Clock()
        self.lanes: dict[Priority, deque[Item]] = {lane: deque() for lane in LANES}
        self.tokens = {lane: 0 for lane in LANES}  # queued, per lane
        self.since: dict[int, float] = {}  # id(item) -> when its task was taken (clock seconds)
        self.owed = 0  # tokens of pack room normal work is owed and has not had yet
        self.running: deque[Running] = deque()  # launched, not read out yet; oldest first
        self.ready = threading.Condition()

    def put(self, items: list[Item], waited: float = 0.0) -> None:
        """Queue a task's prompts in their lane (any thread), at once: a pack formed meanwhile sees all or
        none. ``waited``: seconds since the task was taken (its planning), counted against the lane's target."""
        with self.ready:
            now = self.clock.now()
            for item in items:
                self.lanes[item.lane].append(item)
                self.tokens[item.lane] += item.tokens
                self.since[id(item)] = now - waited
            self.ready.notify()

    def withdraw(self, task: Task) -> bool:
        """Take every prompt of ``task`` out (any thread), if none of them has left for a pack yet: True; else
        leave them all (its answers come as usual) and False. Under the lock ``next`` takes packs under, so a
        prompt is either withdrawn here or packed there, never both."""
        with self.ready:
            queued = [item for item in self.lanes[task.delivery.lane] if item.task is task]
            if len(queued) != len(task.prompts):
                return False
            lane = self.lanes[task.delivery.lane]
            kept = [item for item in lane if item.task is not task]
            lane.clear()
            lane.extend(kept)
            self.tokens[task.delivery.lane] -= sum(item.tokens for item in queued)
            for item in queued:
                self.since.pop(id(item), None)
            return True

    def next(self, timeout: float = 0.25, wait: bool = True, behind: bool = False) -> list[Item]:
        """The next pack (possibly empty after ``timeout`` with no work). ``wait=False``: take what is there.
        ``behind``: a pack runs (``launched``); the next is formed just before it ends, or none."""
        with self.ready:
            if behind and self.running:
                return self._behind(self.running[-1])
            if not (self._wait_for(self._queued, timeout) if wait else self._queued()):
                return []
            if wait and self.max_wait:  # a partly filled pack waits at most max_wait for company
                self._wait_for(lambda: sum(self.tokens.values()) >= self.budget, self.max_wait)
            start = self.clock.now() + self.policy.launch_seconds
            return self._fill(self.policy.size(self._waiting(), start))

    def launched(self, tokens: int, began: float, pending: Pending) -> None:
        """A pack of ``tokens`` went to the GPU: its launch began at ``began`` (clock) and returned now."""
        with self.ready:
            now = self.clock.now()
            policy = self.policy
            policy.launched(now - began)
            size = policy.holding(tokens) if tokens <= policy.sizes[-1] else tokens
            start = max(began, self.running[-1].ends_at) if self.running else began
            self.running.append(Running(pending, size, began, start, start + policy.costs.seconds(size)))

    def finished(self, pending: Pending, seconds: float | None) -> None:
        """A launched pack is read out (``seconds``: its run on the device; None: it failed)."""
        with self.ready:
            index = next((i for i, running in enumerate(self.running) if running.pending is pending), None)
            if index is None:
                return
            ended, now = self.running[index], self.clock.now()
            del self.running[index]
            if seconds is not None and ended.size in self.policy.sizes:
                self.policy.costs.observe(ended.size, seconds)
            if index == 0 and self.running:  # the next one started when this one ended (at the latest now)
                following = self.running[0]
                end = now if seconds is None else min(now, ended.starts_at + seconds)
                following.starts_at = max(following.launched_at, end)
                following.ends_at = following.starts_at + self.policy.costs.seconds(following.size)

    def _behind(self, running: Running) -> list[Item]:
        """Behind a running pack: the next one, formed when the running one is about to end (``Policy.lead``),
        or a full one of the largest size sooner (``Policy.ahead``); none if nothing is queued by then or the
        running pack is done already."""
        policy = self.policy
        tried = -1  # the tokens queued when a full pack was last tried for (tried again only with more)
        while True:
            now = self.clock.now()
            if running.pending.done():
                return []
            size = policy.size(self._waiting(), max(running.ends_at, now + policy.launch_seconds))
            launch_at = running.ends_at - policy.lead(running.size)
            if now >= launch_at:
                return self._fill(size) if self._queued() else []
            queued = sum(self.tokens.values())
            ahead_at = running.ends_at - policy.ahead(size)
            if now >= ahead_at and queued > tried and queued >= FULL * size:
                tried = queued
                if pack := self._full(size):
                    return pack
            moment = min(each for each in (ahead_at, launch_at) if each > now)
            # until the moment, or a put; whether the pack ended sooner than expected is looked at every POLL_S
            self.clock.wait(self.ready, min(moment - now, POLL_S))

    def _wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        deadline = self.clock.now() + timeout
        while not predicate():
            left = deadline - self.clock.now()
            if left <= 0:
                return False
            self.clock.wait(self.ready, left)
        return True

    def _waiting(self) -> Waiting:
        oldest = {lane: self.since.get(id(queue[0])) if queue else None for lane, queue in self.lanes.items()}
        return Waiting(sum(self.tokens.values()), self.tokens[HIGH], oldest)

    def _full(self, size: int) -> list[Item]:
        """A pack filled to at least ``FULL`` of ``size``, else none and the queue as it was: what is queued may
        not pack that well (prompts that do not fit together, a long one in front)."""
        lanes = {lane: deque(queue) for lane, queue in self.lanes.items()}
        tokens, owed, since = dict(self.tokens), self.owed, dict(self.since)
        pack = self._fill(size)
        got = self._tokens(pack)
        if got >= FULL * size:
            return pack
        self.lanes, self.tokens, self.owed, self.since = lanes, tokens, owed, since
        return []

    def _queued(self) -> bool:
        return any(self.lanes.values())

    def _fill(self, budget: int) -> list[Item]:
        """High first, leaving normal work the room it is owed; then normal; then either, first fit, in what
        is left."""
        high, normal = self.lanes[HIGH], self.lanes[NORMAL]
        self.owed = min(self.owed + math.ceil(self.normal_share * budget), budget) if normal else 0
        pack: list[Item] = []
        if high and self.owed < budget:  # the oldest high prompt opens the pack, unless normal is owed it all
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
        """Move the lane's prompts that fit under ``limit`` tokens into ``pack``, oldest first, passing over at
        most ``HOLD`` that do not; those keep their place. (A window of HOLD prompts in all left a large pack of
        short high prompts half full of high work, and normal work filled the rest far beyond its share.)"""
        queue, passed = self.lanes[lane], []
        used = self._tokens(pack)
        while queue and used < limit and len(passed) < HOLD:
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
        self.since.pop(id(item), None)

    @staticmethod
    def _tokens(pack: list[Item]) -> int:
        return sum(item.tokens for item in pack)
