"""What a plan of the producer's core (plans.py) yields for a face to send (client.py): one Redis exchange
each, a plain object with no socket. The face sends it and hands the reply back, or throws the error in.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..plumbing.cluster_wait import Routed
from ..wire.keys import Keys

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """One Redis command: the redis-py method and its arguments."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Pipeline:
    """Commands sent in one round trip (no transaction); the reply is the list of their replies."""

    calls: list[Call]
    wait: int = 0  # durable mode: its last call is a WAIT for this many replicas
    raising: bool = True  # False: a command Redis refused answers its error in the list instead of raising


@dataclass(frozen=True)
class Function:
    """A call of one function of the library (``FCALL``)."""

    name: str
    keys: list[str]
    args: list[Any]
    wait: int = 0  # durable mode: sent with a WAIT for this many replicas; the reply is [its reply, replicas]


@dataclass(frozen=True)
class PerNode:
    """Durable mode on Redis Cluster: commands sent in one pipeline per primary, each ending with a WAIT for
    ``wait`` replicas (producer/plumbing/cluster_wait.py); ``marks``: reads, each node's confirmed by a
    replicated write after them. The reply is a ``cluster_wait.Confirmed``: each command's reply and the
    replicas that confirmed it."""

    calls: list[Routed]
    wait: int
    marks: Keys | None = None


@dataclass(frozen=True)
class Load:
    """Load the function library if the server has none (``library.ensure``): the reply is a
    ``library.Loaded``, or ``library.LibraryUnavailable`` is thrown in."""


Step = Call | Pipeline | Function | PerNode | Load
Plan = Generator[Step, Any, T]
