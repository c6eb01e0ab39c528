"""A Redis command, one shape for every role: its words and the key whose slot routes it; and the ways a
batch of them is sent: one command (a function call is one), a ``Pipeline``. Durable mode, a batch confirmed
by replicas, is durable.py's.

The words are what Redis reads, but a name of two words is one string ("XINFO GROUPS", "FUNCTION LOAD"), as
redis-py writes it: its reply parsers are keyed by it, so a reply comes back as the client's own method would
give it. The key matters on Redis Cluster alone, where durable mode groups commands by the primary of their
key's slot (cluster_wait.py); a cluster client finds a plain command's node from its words itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Command:
    """One Redis command: its words, and the key whose slot routes it (its first key; None: keyless).
    ``options``: what redis-py is told beside the words, where its own method would tell it (``target_nodes``:
    where a cluster client sends it; ``parse_detail``: how XPENDING's reply is read)."""

    words: tuple[Any, ...]
    key: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Pipeline:
    """Commands sent in one round trip (no transaction); the reply is the list of their replies.
    ``raising=False``: a command Redis refused answers its error in the list (as itself, not prefixed with
    the command), else the first refusal raises."""

    commands: list[Command]
    raising: bool = True


def command(*words: Any) -> Command:
    """A command whose first argument is its key (XRANGE, HGETALL, GET, ...), routed by it."""
    return Command(words, str(words[1]))


def fcall(name: str, keys: list[str], args: list[Any]) -> Command:
    """A call of a library function, routed by its first key (every key of a call shares its slot)."""
    return Command(("FCALL", name, len(keys), *keys, *args), keys[0] if keys else None)


def wait(replicas: int, wait_ms: int) -> Command:
    """``WAIT``: how many replicas have every write sent before it on its connection, within ``wait_ms``."""
    return Command(("WAIT", replicas, wait_ms))


def hset(key: str, mapping: dict[Any, Any]) -> Command:
    """``HSET`` of a mapping's fields."""
    return Command(("HSET", key, *(word for pair in mapping.items() for word in pair)), key)


def send(client: Any, command: Command) -> Any:
    """Send one command on a blocking client (or queue it on a pipeline)."""
    return client.execute_command(*command.words, **command.options)


async def asend(client: Any, command: Command) -> Any:
    """``send`` on an asyncio client."""
    return await client.execute_command(*command.words, **command.options)


def pipelined(client: Any, batch: Pipeline) -> list[Any]:
    """Send a pipeline on a blocking client: its replies in order."""
    with client.pipeline(transaction=False) as pipe:
        for each in batch.commands:
            send(pipe, each)
        return pipe.execute(raise_on_error=batch.raising)


async def apipelined(client: Any, batch: Pipeline) -> list[Any]:
    """``pipelined`` on an asyncio client."""
    async with client.pipeline(transaction=False) as pipe:
        for each in batch.commands:
            send(pipe, each)
        return await pipe.execute(raise_on_error=batch.raising)
