"""The Redis servers this project supports, and the check that producers and workers make when they connect.

Redis >= 7.0 and Valkey >= 7.2 (every Valkey release). The guarantees rest on what Redis 7.0 added to streams:
``XAUTOCLAIM`` drops pending entries whose payload was deleted and names them (a trimmed entry is reported and
acknowledged, not pending forever), ``XINFO GROUPS`` reports the group's lag (``dq_stream_lag``, ``stats`` and
KEDA's scaling signal), and ACL selectors (``ops/redis_acl.py``). On 6.2 these fail silently, so older servers
are refused at connect with the version found and the minimum, never served half-working.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..wire.errors import DecisionQueueError
from ..wire.keys import text

MINIMUM = {"redis": (7, 0), "valkey": (7, 2)}
NAMES = {"redis": "Redis", "valkey": "Valkey"}


def supported() -> str:
    """``Redis >= 7.0 or Valkey >= 7.2``: for messages."""
    return " or ".join(f"{NAMES[family]} >= {'.'.join(map(str, version))}" for family, version in MINIMUM.items())


class UnsupportedServer(DecisionQueueError, RuntimeError):
    """The server is older than the project supports (or does not say what it is)."""


def version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for part in text.strip().split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


@dataclass(frozen=True)
class Server:
    """What a server says it is: ``family`` redis or valkey, and its version."""

    family: str
    version: tuple[int, ...]

    @property
    def supported(self) -> bool:
        return self.family in MINIMUM and self.version >= MINIMUM[self.family]

    @property
    def label(self) -> str:
        """``valkey-9.1.2``: for test ids and file names."""
        return f"{self.family}-{'.'.join(map(str, self.version))}"

    def __str__(self) -> str:
        return f"{NAMES.get(self.family, self.family)} {'.'.join(map(str, self.version)) or '(unknown version)'}"


def from_hello(reply: Any) -> Server:
    """The server of a ``HELLO`` reply (a map in RESP3, a flat list of pairs in RESP2)."""
    if isinstance(reply, (list, tuple)):
        reply = dict(zip(reply[::2], reply[1::2]))
    fields = {text(k): v for k, v in dict(reply).items()}
    family = text(fields.get("server", "")).lower()
    return Server(family if family in MINIMUM else family or "unknown", version_tuple(text(fields.get("version", ""))))


def require(server: Server, where: str = "") -> Server:
    """``server`` if supported, else UnsupportedServer naming what was found and what is needed."""
    if not server.supported:
        at = f" at {where}" if where else ""
        raise UnsupportedServer(f"unsupported server{at}: {server} found, this project needs {supported()} "
                                f"(streams' lag, XAUTOCLAIM of deleted entries and ACL selectors need 7.0)")
    return server


def _refused(error: Exception, where: str) -> UnsupportedServer:
    at = f" at {where}" if where else ""
    return UnsupportedServer(f"unsupported server{at}: HELLO failed ({error}), so it is older than Redis 6; "
                             f"this project needs {supported()}")


def lag_of(length: int, pending: int, lag: int | None) -> int:
    """The group's lag (entries not yet delivered): ``XINFO GROUPS``' own figure, or, when the server reports
    NULL, the stream's length less its pending entries. Redis and Valkey cannot count the lag once an entry
    after the oldest one left was deleted (workers delete answered entries in any order), and a NULL read as 0
    would tell an autoscaler there is nothing to do; the length less pending is exact here because answered
    entries are deleted."""
    return int(lag) if lag is not None else max(0, int(length) - int(pending))


def _every_node(connection: Any) -> dict[str, Any]:
    """Redis Cluster: ask every node, named (a HELLO has no key to route by)."""
    return {"target_nodes": connection.get_nodes()} if hasattr(connection, "get_nodes") else {}


def _judge(reply: Any, where: str) -> Server:
    """The one server of a reply, or the oldest of a cluster's nodes' replies (a dict by node name)."""
    replies = [reply]
    if isinstance(reply, dict) and not {"server", b"server"} & set(reply):
        replies = list(reply.values())
    servers = sorted((from_hello(r) for r in replies), key=lambda s: (s.supported, s.version))
    for server in servers:
        require(server, where)
    return servers[0]


def check(connection: Any, where: str = "") -> Server:
    """Ask a synchronous client's server (every node of a cluster) what it is, with ``HELLO``; raise
    UnsupportedServer unless supported. Connection errors pass through: an unreachable server is not an
    unsupported one."""
    import redis

    try:
        reply = connection.execute_command("HELLO", **_every_node(connection))
    except redis.ResponseError as error:
        raise _refused(error, where) from None
    return _judge(reply, where)


async def acheck(connection: Any, where: str = "") -> Server:
    """``check`` for an asyncio client."""
    import redis

    if hasattr(connection, "get_nodes") and not connection.get_nodes():
        await connection.initialize()  # an asyncio cluster client learns its nodes on first use
    try:
        reply = await connection.execute_command("HELLO", **_every_node(connection))
    except redis.ResponseError as error:
        raise _refused(error, where) from None
    return _judge(reply, where)
