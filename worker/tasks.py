"""The plain objects handed between the daemon's stages: a stream entry, the task it becomes, a chunk of work."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from producer.schema import Request

from .model.engine import Chunk
from .model.readout import Answer

REQUESTS, CHUNKS = "requests", "chunks"


@dataclass
class Delivery:
    """One stream entry as Redis handed it to this consumer."""

    stream: str  # REQUESTS or CHUNKS
    key: str  # the stream's Redis key
    entry_id: str
    fields: dict[bytes, bytes]
    deliveries: int  # Redis' delivery counter, this delivery included
    taken: float = field(default_factory=time.time)

    @property
    def enqueued_ms(self) -> int:
        """Entry ids start with the enqueue time in ms; parts carry their request's."""
        if b"enqueued_ms" in self.fields:
            return int(self.fields[b"enqueued_ms"])
        return int(self.entry_id.split("-")[0])


@dataclass
class Task:
    """The work of one entry: a whole request, or one part of a fanned-out request."""

    delivery: Delivery
    request_id: str
    request: Request
    part: int = 0
    parts: int = 1
    chunks: list[Chunk] = field(default_factory=list)
    answers: dict[str, Answer] = field(default_factory=dict)
    remaining: int = 0
    compute_seconds: float = 0.0
    cancelled: bool = False  # failed or expired: its chunks still queued are skipped

    @property
    def tokens(self) -> int:
        return sum(chunk.length for chunk in self.chunks)

    @property
    def expired(self) -> bool:
        deadline = self.request.deadline_ms
        return deadline is not None and time.time() * 1000 > deadline


@dataclass(frozen=True)
class Item:
    """One chunk of a task on its way to the GPU."""

    task: Task
    index: int
    chunk: Chunk

    @property
    def tokens(self) -> int:
        return self.chunk.length
