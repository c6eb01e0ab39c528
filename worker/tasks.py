"""The plain objects handed between the queue stages: where a held entry is in its life (``State``: the one
list of states, which the metrics name too), the task an entry becomes, the prompts of work it holds, and what
the GPU thread hands the Redis loop about them (``GpuEvent``: one typed event per fact, handed over by
``LoopThread.hand_over``).

Torch-free at run time: prompts and answers are only named here, for their types.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from producer.wire.keys import Priority
from producer.wire.schema import Request

from .entries import Delivery, Identity

if TYPE_CHECKING:
    from .model.engine import Prompt
    from .model.readout import Answer


class State(enum.StrEnum):
    """Where a held entry is in its life."""

    TAKEN = "taken"  # held and being routed, or taken again for a retry
    PLANNING = "planning"  # with the planners: its body parsed, validated, rendered, tokenized
    QUEUED = "queued"  # its prompts wait in the packer
    COMPUTING = "computing"  # a pack with one of its prompts went to the GPU
    SETTLING = "settling"  # its end is being written: a result, a dead letter, its parts (a fan-out), an ack


@dataclass
class Timeline:
    """When a task reached each step of its way through this worker (``time.time()``): the time it spent in
    each ``State``, observed once it is settled."""

    queued: float = 0.0  # its prompts went to the packer
    launched: float = 0.0  # the pack holding its last prompt went to the GPU
    computed: float = 0.0  # its last prompt's answers were read out


@dataclass
class Task:
    """The work of one entry: a whole request, or one part of a fanned-out request."""

    delivery: Delivery
    identity: Identity  # from the same parse as ``request``
    request: Request
    prompts: list[Prompt] = field(default_factory=list)
    # question names per part, when it fans out (planner)
    fan_out: list[list[str]] = field(default_factory=list)
    answers: dict[str, Answer] = field(default_factory=dict)
    remaining: int = 0  # prompts not answered yet
    compute_seconds: float = 0.0
    # ended early (failed, expired): its prompts still queued are skipped, late answers dropped
    closed: bool = False
    timeline: Timeline = field(default_factory=Timeline)

    @property
    def request_id(self) -> str:
        return self.identity.request_id

    @property
    def tokens(self) -> int:
        return sum(prompt.length for prompt in self.prompts)

    @property
    def expired(self) -> bool:
        deadline = self.request.deadline_ms
        return deadline is not None and time.time() * 1000 > deadline


@dataclass(frozen=True)
class Item:
    """One prompt of a task on its way to the GPU."""

    task: Task
    index: int
    prompt: Prompt

    @property
    def tokens(self) -> int:
        """The pack room it takes (worker/model/engine.py, ``Prompt.room``)."""
        return self.prompt.room

    @property
    def lane(self) -> Priority:
        return self.task.delivery.lane


# ---- what the GPU thread hands the Redis loop (compute.py -> LoopThread.hand_over)


@dataclass(frozen=True)
class Launched:
    """A pack holding these prompts went to the GPU."""

    items: tuple[Item, ...]
    at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Computed:
    """One prompt's answers, and its share of its pack's time."""

    item: Item
    answers: list[Answer]
    seconds: float
    at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Failed:
    """A prompt of the task failed alone (its pack bisected down to it)."""

    task: Task
    reason: str


@dataclass(frozen=True)
class Expired:
    """The task's deadline passed before its prompt was computed."""

    task: Task


GpuEvent = Launched | Computed | Failed | Expired
