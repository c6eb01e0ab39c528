"""Redis behind Sentinel: the URL form
``redis+sentinel://[user:password@]host1:port1,host2:port2/SERVICE[/db]`` (``rediss+sentinel://`` for TLS),
parsed and checked once, and the clients redis-py's own Sentinel support makes of it.

A client asks the sentinels for the service's primary on every new connection; after a failover the old
primary's connections fail (or answer READONLY), are dropped, and the next one goes to the promoted replica:
workers and producers follow a failover without a restart, within the retries of
producer/plumbing/connection.py. The user and password are the data nodes' (the queue's ACL users); the
sentinels are asked with credentials of their own where they require some (``DQ_SENTINEL_USERNAME``,
``DQ_SENTINEL_PASSWORD``: ``credentials``), else without, over TLS with the same files when the scheme is
``rediss+sentinel``. A sentinel that refuses them is named as such (redis-py reports it as "no master found").
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis

SCHEMES = ("redis+sentinel", "rediss+sentinel")
CREDENTIALS = ("sentinel_username", "sentinel_password")  # connection options that go to the sentinels alone
SERVICE = re.compile(r"\A[A-Za-z0-9._-]{1,128}\Z")
DEFAULT_PORT = 26379
PORT, DATABASE = re.compile(r"\A[0-9]{1,5}\Z"), re.compile(r"\A[0-9]{1,10}\Z")
MAX_DATABASE = 2**31 - 1  # Redis's own bound on a database number (its `databases` setting is an int)


def is_sentinel(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SCHEMES


@dataclass(frozen=True)
class SentinelUrl:
    """What a Sentinel URL names: the sentinels, the service (the primary's name in their configuration), the
    database, the data nodes' credentials, TLS or not."""

    sentinels: tuple[tuple[str, int], ...]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: bool = False


def parse(url: str) -> SentinelUrl:
    """The parts of a Sentinel URL; ValueError naming what is wrong, never quoting the URL (it may hold a
    password)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError("a Sentinel URL starts with redis+sentinel:// or rediss+sentinel://")
    netloc, _, path = rest.partition("/")
    if "?" in rest or "#" in rest:
        raise ValueError("a Sentinel URL takes no query or fragment (percent-encode ? as %3F, # as %23)")
    credentials, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = credentials.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if colon else None)
        if not colon:  # redis-py's rule for redis://secret@host: a lone part is the password
            username, password = None, unquote(user)
    sentinels = [_sentinel(host) for host in hosts.split(",")]
    parts = [p for p in path.split("/")] if path else []
    if not parts or not SERVICE.fullmatch(parts[0]):
        raise ValueError("a Sentinel URL names its service after the hosts: /SERVICE_NAME (1-128 of A-Z a-z "
                         "0-9 . _ -)")
    if len(parts) > 2 or (len(parts) == 2 and not DATABASE.fullmatch(parts[1])):
        raise ValueError(f"after the service, a Sentinel URL takes only a database number (/SERVICE/0), 0 to "
                         f"{MAX_DATABASE}")
    db = int(parts[1]) if len(parts) == 2 else 0
    if db > MAX_DATABASE:
        raise ValueError(f"a database number is 0 to {MAX_DATABASE}")
    return SentinelUrl(tuple(sentinels), parts[0], db, username, password, scheme.lower() == "rediss+sentinel")


def _sentinel(host: str) -> tuple[str, int]:
    """``host:port`` (a name, an IPv4 address, or an IPv6 one in brackets; a bare IPv6 address takes no port),
    or the name alone and the default port. ``h:-1`` was taken for a host named ``h:-1``."""
    bracketed = host.startswith("[")
    name, colon, port = host.rpartition(":")
    if bracketed:
        name, close, rest = host[1:].partition("]")
        if not close or (rest and not rest.startswith(":")):
            raise ValueError("each sentinel is host:port, separated by commas; an IPv6 address in brackets")
        colon, port = rest[:1], rest[1:]
    elif not colon or ":" in name:  # no port, or a bare IPv6 address (its last group is no port)
        name, colon, port = host, "", ""
    if not name or not re.fullmatch(r"[A-Za-z0-9._-]+" if not (bracketed or ":" in name) else r"[0-9A-Fa-f:.]+",
                                    name):
        raise ValueError("each sentinel is host:port, separated by commas")
    if colon and not (PORT.fullmatch(port) and 0 < int(port) < 65536):
        raise ValueError("a sentinel's port is 1 to 65535")
    return name, int(port) if colon else DEFAULT_PORT


def redact(url: str) -> str:
    """The URL without its password."""
    scheme, _, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    credentials, at, hosts = netloc.rpartition("@")
    if not at:
        return url
    user = credentials.partition(":")[0] if ":" in credentials else ""
    return f"{scheme}://{user}:***@{hosts}{slash}{path}"


def credentials(username: str, password: str) -> dict[str, str]:
    """The sentinels' own user and password as connection options, those given (``master`` hands them to the
    sentinels alone)."""
    return {name: value for name, value in zip(CREDENTIALS, (username, password)) if value}


def _split(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The data nodes' options, and the sentinels' (timeouts, TLS files and their credentials; no retry
    policy: a sentinel that does not answer is skipped for the next)."""
    shared = ("socket_timeout", "socket_connect_timeout", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
    asked = {name: options[name] for name in shared if name in options}
    asked.update({name.removeprefix("sentinel_"): options[name] for name in CREDENTIALS if name in options})
    return {name: value for name, value in options.items() if name not in CREDENTIALS}, asked


def _named(error: Exception) -> Exception:
    """redis-py folds the sentinels' authentication refusals into "No master found" (with every sentinel
    client's description): say it, with their reasons (never the secret)."""
    reasons = dict.fromkeys(re.findall(r"\w*Authentication\w*: [^,]*", str(error)))
    if reasons:
        return redis.AuthenticationError(f"the sentinels refused authentication ({'; '.join(reasons)}): set their "
                                         f"user and password with DQ_SENTINEL_USERNAME and DQ_SENTINEL_PASSWORD")
    return error


ASK_EVERY_S = 1.0  # how often a pool asks the sentinels where the primary is, at most


def _pools() -> tuple[type, type]:
    """Sentinel connection pools (synchronous, asyncio) that follow a failover at once.

    redis-py's pool asks the sentinels only when it opens a connection, and keeps the ones it has; a primary
    the sentinels replaced keeps answering until they make it a replica (about 10 s after a planned or a
    frozen primary's failover: measured, docs/RELIABILITY.md), and writes it takes then are lost. These ask
    again at most once a second when handing out a connection, and drop one that leads elsewhere than the
    primary named now."""
    import redis.asyncio.sentinel as aio
    import redis.sentinel as sync

    class Following(sync.SentinelConnectionPool):
        """The blocking pool that follows a failover."""

        asked = float("-inf")

        def get_master_address(self) -> Any:
            try:
                return super().get_master_address()
            except sync.MasterNotFoundError as error:
                raise _named(error) from None

        def get_connection(self, *args: Any, **kwargs: Any) -> Any:
            if time.monotonic() - self.asked >= ASK_EVERY_S:
                self.asked = time.monotonic()
                self.get_master_address()  # drops idle connections when the primary moved
            connection = super().get_connection(*args, **kwargs)
            if connection._sock is not None and (connection.host, connection.port) != self.master_address:
                connection.disconnect()  # it reconnects, asking the sentinels, when used
            return connection

    class AsyncFollowing(aio.SentinelConnectionPool):
        """The asyncio pool that follows a failover."""

        asked = float("-inf")

        async def get_master_address(self) -> Any:
            try:
                return await super().get_master_address()
            except aio.MasterNotFoundError as error:
                raise _named(error) from None

        async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
            if time.monotonic() - self.asked >= ASK_EVERY_S:
                self.asked = time.monotonic()
                await self.get_master_address()
            connection = await super().get_connection(*args, **kwargs)
            if connection.is_connected and (connection.host, connection.port) != self.master_address:
                await connection.disconnect()
            return connection

    return Following, AsyncFollowing


def master(url: str, options: dict[str, Any], asyncio: bool = False) -> Any:
    """A client (synchronous, or asyncio) of the service's primary."""
    if asyncio:
        from redis.asyncio.sentinel import Sentinel
    else:
        from redis.sentinel import Sentinel  # type: ignore[assignment]

    target = parse(url)
    data, asked = _split(options)
    tls = {"ssl": True} if target.tls else {}
    sentinel = Sentinel(target.sentinels, sentinel_kwargs={**asked, **tls})
    return sentinel.master_for(target.service, db=target.db, username=target.username, password=target.password,
                               connection_pool_class=_pools()[asyncio], **tls, **data)


def follow(client: Any) -> None:
    """After replicas did not confirm: drop the idle connections, so that the next call asks the sentinels
    again. A primary they replaced keeps answering until they make it a replica (frozen and let go, or handed
    over: seconds), and redis-py's pool keeps its connections to it beside new ones to the promoted node.
    Nothing for a client of any other kind."""
    from redis.sentinel import SentinelConnectionPool

    if isinstance(getattr(client, "connection_pool", None), SentinelConnectionPool):
        client.connection_pool.disconnect(inuse_connections=False)


async def afollow(client: Any) -> None:
    """``follow`` for an asyncio client."""
    from redis.asyncio.sentinel import SentinelConnectionPool

    if isinstance(getattr(client, "connection_pool", None), SentinelConnectionPool):
        await client.connection_pool.disconnect(inuse_connections=False)
