"""Chunks -> packs: fill one forward pass up to the token budget, waiting at most ``max_wait`` for more work.

Chunks are taken oldest first; one that does not fit the pack being formed is held for the next pack, and later,
smaller chunks may still fill the gap (first fit over a short window), so packs stay full without starving anyone:
a held chunk always opens the next pack.
"""

from __future__ import annotations

import queue
import time
from collections import deque

from .tasks import Item

HOLD = 64  # chunks set aside per pack at most, before the pack is closed as it is


class Packer:
    def __init__(self, source: queue.Queue[Item], budget: int, max_wait: float) -> None:
        self.source = source
        self.budget = budget
        self.max_wait = max_wait
        self.held: deque[Item] = deque()

    @property
    def idle(self) -> bool:
        return not self.held and self.source.empty()

    def next(self, timeout: float = 0.25, wait: bool = True) -> list[Item]:
        """The next pack (possibly empty after ``timeout`` with no work). ``wait=False``: take what is there."""
        pack: list[Item] = []
        used = 0
        carried: deque[Item] = deque()
        while self.held:  # held chunks first, oldest first
            item = self.held.popleft()
            if not pack or used + item.tokens <= self.budget:
                pack.append(item)
                used += item.tokens
            else:
                carried.append(item)
        self.held = carried
        deadline = time.monotonic() + (self.max_wait if pack else timeout)
        opened = bool(pack)
        while used < self.budget and len(self.held) < HOLD:
            left = deadline - time.monotonic()
            try:  # past the latency bound, only what is already queued joins
                item = self.source.get(timeout=left) if wait and left > 0 else self.source.get_nowait()
            except queue.Empty:
                break
            if not opened:  # the latency bound runs from the first chunk of the pack
                deadline, opened = time.monotonic() + self.max_wait, True
            if not pack or used + item.tokens <= self.budget:
                pack.append(item)
                used += item.tokens
            else:
                self.held.append(item)
        return pack
