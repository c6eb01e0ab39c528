"""Redis behind Sentinel: the URL form ``redis+sentinel://[user:password@]host1:port1,host2:port2/SERVICE[/db]``
(``rediss+sentinel://`` for TLS), parsed and checked once, and the clients redis-py's own Sentinel support makes
of it.

A client asks the sentinels for the service's primary on every new connection; after a failover the old primary's
connections fail (or answer READONLY), are dropped, and the next one goes to the promoted replica: workers and
producers follow a failover without a restart, within the retries of producer/connection.py. The user and password
are the data nodes' (the queue's ACL users); the sentinels are asked without them, over TLS with the same files
when the scheme is ``rediss+sentinel``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

SCHEMES = ("redis+sentinel", "rediss+sentinel")
SERVICE = re.compile(r"\A[A-Za-z0-9._-]{1,128}\Z")
DEFAULT_PORT = 26379


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
    if "?" in path or "#" in path:
        raise ValueError("a Sentinel URL takes no query or fragment (percent-encode ? as %3F, # as %23)")
    credentials, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = credentials.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if colon else None)
        if not colon:  # redis-py's rule for redis://secret@host: a lone part is the password
            username, password = None, unquote(user)
    sentinels = []
    for host in hosts.split(","):
        name, colon, port = host.rpartition(":") if host.rpartition(":")[2].isdigit() else (host, "", "")
        name = name.strip("[]")
        if not name or not re.fullmatch(r"[A-Za-z0-9._:-]+", name):
            raise ValueError("each sentinel is host:port, separated by commas")
        number = int(port) if colon else DEFAULT_PORT
        if not 0 < number < 65536:
            raise ValueError("a sentinel's port is 1 to 65535")
        sentinels.append((name, number))
    parts = [p for p in path.split("/")] if path else []
    if not parts or not SERVICE.fullmatch(parts[0]):
        raise ValueError("a Sentinel URL names its service after the hosts: /SERVICE_NAME (1-128 of A-Z a-z "
                         "0-9 . _ -)")
    if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ValueError("after the service, a Sentinel URL takes only a database number (/SERVICE/0)")
    db = int(parts[1]) if len(parts) == 2 else 0
    return SentinelUrl(tuple(sentinels), parts[0], db, username, password, scheme.lower() == "rediss+sentinel")


def redact(url: str) -> str:
    """The URL without its password."""
    scheme, _, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    credentials, at, hosts = netloc.rpartition("@")
    if not at:
        return url
    user = credentials.partition(":")[0] if ":" in credentials else ""
    return f"{scheme}://{user}:***@{hosts}{slash}{path}"


def _split(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The data nodes' options, and the sentinels' (timeouts and TLS files, no retry policy: a sentinel that does
    not answer is skipped for the next)."""
    shared = ("socket_timeout", "socket_connect_timeout", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
    return dict(options), {name: options[name] for name in shared if name in options}


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
                               **tls, **data)
