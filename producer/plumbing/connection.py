"""Reaching Redis: the deployment a producer talks to, read from the same ``DQ_*`` variables the worker reads,
and the connection options both client faces (and the worker) use.

Arguments win over the environment, the environment over the defaults, as for the worker's settings.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from . import sentinel

DEFAULT_URL = "redis://127.0.0.1:6379/0"
SOCKET_TIMEOUT = 5.0
# redis-py's default retry (a few jittered retries) gives up after about a second of refused connections: less
# than a Redis restart. These ride out ~12 s. A retried call may run twice (lost reply): results are published
# once whatever happens, and a request enqueued twice is answered once (docs/RELIABILITY.md).
RETRIES, RETRY_BASE, RETRY_CAP = 16, 0.05, 1.0
# Durable mode: how long one WAIT for the replicas may take before the write is reported not durable.
WAIT_MS = 2000
TLS_OPTIONS = {"tls_ca": "ssl_ca_certs", "tls_cert": "ssl_certfile", "tls_key": "ssl_keyfile"}


@dataclass(frozen=True)
class Deployment:
    """Where requests go: the Redis URL, the namespace, Redis Cluster or not, the stream shards, TLS files."""

    url: str = DEFAULT_URL
    namespace: str = "dq"
    cluster: bool = False
    shards: int = 1
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    # Durable mode: a write counts once this many replicas have it (docs/RELIABILITY.md).
    wait_replicas: int = 0
    # The sentinels' own user and password, when they require one (requirepass, ACL).
    sentinel_username: str = ""
    sentinel_password: str = dataclasses.field(default="", repr=False)

    # The worker's variable names (worker/config.py), and DQ_SHARDS: how many shards producers spread over.
    ENV = {"url": "DQ_REDIS_URL", "namespace": "DQ_NAMESPACE", "cluster": "DQ_REDIS_CLUSTER",
           "shards": "DQ_SHARDS", "tls_ca": "DQ_REDIS_TLS_CA", "tls_cert": "DQ_REDIS_TLS_CERT",
           "tls_key": "DQ_REDIS_TLS_KEY", "wait_replicas": "DQ_WAIT_REPLICAS",
           "sentinel_username": "DQ_SENTINEL_USERNAME", "sentinel_password": "DQ_SENTINEL_PASSWORD"}
    # Each field's flags (the first one shown), metavar and help: the worker's names (worker/config.py), so
    # that dq-producer, dq-gateway and dq-worker load-functions spell the connection alike.
    FLAGS = {
        "url": (["--redis-url", "--redis"], "URL",
                "Redis URL (rediss:// for TLS; redis://user:password@host for an ACL user; "
                "redis+sentinel://host:port,host:port/SERVICE[/db] through Sentinel)"),
        "namespace": (["--namespace"], "NAME", "prefix of every Redis name of the deployment"),
        "cluster": (["--redis-cluster", "--cluster"], None, "the URL is a node of a Redis Cluster"),
        "shards": (["--shards"], "N",
                   "stream shards of the deployment: submit spreads over them, stats shows each"),
        "tls_ca": (["--redis-tls-ca"], "FILE",
                   "CA certificate file that verifies the Redis server (rediss://)"),
        "tls_cert": (["--redis-tls-cert"], "FILE",
                     "client certificate file, when Redis requires one (rediss://)"),
        "tls_key": (["--redis-tls-key"], "FILE", "the client certificate's private key file (rediss://)"),
        "wait_replicas": (["--wait-replicas"], "N",
                          "durable mode: an enqueue is acknowledged, a result read, once N replicas have it "
                          "(0: off)"),
        "sentinel_username": (["--sentinel-username"], "USER",
                              "the sentinels' user, when they require one (the URL's user is the data "
                              "nodes')"),
        "sentinel_password": (["--sentinel-password"], "PASSWORD",
                              "the sentinels' password, when they require one (prefer the variable: a flag "
                              "shows in the process list)"),
    }

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None, **given: Any) -> Deployment:
        """Each field from ``given`` unless None, else from its ``DQ_*`` variable, else the default;
        checked."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in fields(cls):
            value = given.get(field.name)
            raw = environ.get(cls.ENV[field.name])
            if value is None and raw is not None:
                value = _convert(cls.ENV[field.name], raw, field.default)
            if value is not None:
                values[field.name] = value
        deployment = cls(**values)
        if deployment.url.split("://", 1)[0].lower() not in SCHEMES:
            raise ValueError(f"a Redis URL starts with {', '.join(s + '://' for s in SCHEMES)}, got "
                             f"{redact(deployment.url)}")
        if problem := url_problem(deployment.url):
            raise ValueError(f"the Redis URL is not usable: {problem}")
        if deployment.shards < 1:
            raise ValueError(f"shards must be at least 1, got {deployment.shards}")
        if deployment.tls_files() and not tls_url(deployment.url):
            raise ValueError("TLS files (DQ_REDIS_TLS_*) need a rediss:// or rediss+sentinel:// URL")
        credentials = deployment.sentinel_username or deployment.sentinel_password
        if credentials and not sentinel.is_sentinel(deployment.url):
            raise ValueError("the sentinels' credentials (DQ_SENTINEL_USERNAME, DQ_SENTINEL_PASSWORD) need a "
                             "redis+sentinel:// or rediss+sentinel:// URL")
        if problem := mode_problem(deployment.url, deployment.cluster, deployment.wait_replicas):
            raise ValueError(problem)
        return deployment

    def tls_files(self) -> dict[str, str]:
        """The TLS files as redis-py connection options."""
        return {option: getattr(self, name) for name, option in TLS_OPTIONS.items() if getattr(self, name)}

    def options(self) -> dict[str, str]:
        """The connection options beyond the URL (``connect``): the TLS files, the sentinels' credentials."""
        return {**self.tls_files(), **sentinel.credentials(self.sentinel_username, self.sentinel_password)}

    @property
    def safe_url(self) -> str:
        """The URL without its password, for messages and logs."""
        return redact(self.url)


def _convert(variable: str, raw: str, default: Any) -> Any:
    if isinstance(default, bool):
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return lowered in ("1", "true", "yes", "on")
        raise ValueError(f"{variable}={raw!r} is not a boolean")
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{variable}={raw!r} is not an integer") from None
    return raw


SCHEMES = ("redis", "rediss", "unix", *sentinel.SCHEMES)
MAX_WAIT_REPLICAS = 16


def tls_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in ("rediss", "rediss+sentinel")


def mode_problem(url: str, cluster: bool, wait_replicas: int) -> str | None:
    """Why these connection settings do not go together, or None."""
    if cluster and sentinel.is_sentinel(url):
        return "a Sentinel URL names a primary and its replicas, not a Redis Cluster: leave out --redis-cluster"
    if not 0 <= wait_replicas <= MAX_WAIT_REPLICAS:
        return f"wait_replicas (DQ_WAIT_REPLICAS) must be 0 to {MAX_WAIT_REPLICAS}, got {wait_replicas}"
    return None


def url_problem(url: str) -> str | None:
    """Why ``url`` is not a Redis URL this client would use as written, or None. Never quotes the URL: a
    password with an unencoded ``/``, ``?`` or ``#`` ends the host part early, and what follows it would be
    echoed."""
    if sentinel.is_sentinel(url):
        try:
            sentinel.parse(url)
        except ValueError as error:
            return str(error)
        return None
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError when what follows the user's ":" is not a port
        from redis.connection import parse_url

        parsed = parse_url(url)
    except ValueError:
        return ("it cannot be parsed (percent-encode the user and password: / as %2F, ? as %3F, # as %23, "
                "@ as %40, : as %3A)")
    if parts.scheme in ("redis", "rediss") and not parts.hostname:
        return "it names no host"
    if parts.scheme in ("redis", "rediss") and parts.path not in ("", "/") and "db" not in parsed:
        return "its path is not a database number (/0)"
    if not 0 <= parsed.get("db", 0) <= sentinel.MAX_DATABASE:  # twenty digits were taken, then Redis refused
        return f"its database number is not 0 to {sentinel.MAX_DATABASE}"
    return None


QUERY_PASSWORD = re.compile(r"([?&][^=&#]*pass(?:word|wd)?[^=&#]*=)[^&#]*", re.IGNORECASE)  # its value: ***


def redact(url: str) -> str:
    """The URL without its password, the one form every message and log line prints:
    ``redis://user:***@host/0`` for ``redis://user:secret@host/0``, and ``?password=***`` for a password given
    as a query parameter (redis-py takes any of its options there: ``ssl_password`` too)."""
    if sentinel.is_sentinel(url):  # its hosts and credentials are its own; a query (refused) hidden all the same
        return QUERY_PASSWORD.sub(r"\1***", sentinel.redact(url))
    try:
        parts = urlsplit(url)
        if parts.password is not None:
            user = f"{parts.username}:" if parts.username else ":"
            host = parts.hostname or ""
            netloc = f"{user}***@{host}" + (f":{parts.port}" if parts.port else "")
            url = urlunsplit(parts._replace(netloc=netloc))
    except ValueError:  # not even a URL: say so without echoing what may be a secret
        return "<unparsable URL>"
    return QUERY_PASSWORD.sub(r"\1***", url)


def _options(retry: Any, options: dict[str, Any]) -> dict[str, Any]:
    """Timeouts that suit blocking reads and a retry that rides out a Redis restart; the caller's options win.
    No CLIENT SETINFO on connect: the ACL roles do not grant it (Redis 7.0 lacks it, so an aclfile naming it
    would not load there), and on 7.2+ and Valkey each refusal would fill the ACL log."""
    return {"socket_timeout": SOCKET_TIMEOUT, "socket_connect_timeout": SOCKET_TIMEOUT, "health_check_interval": 30,
            "retry": retry(ExponentialBackoff(RETRY_CAP, RETRY_BASE), RETRIES), "lib_name": None,
            "lib_version": None, **options}


class _Pool(redis.ConnectionPool):
    """redis-py's pool, whose check of a connection it hands out rides out a restart as a command does. The pool
    checks a connection before handing it out, reconnecting once, outside the command's retry: a new connection the
    server closed in that moment (a restart, CLIENT KILL) raised to the caller at once (the chaos test: a
    producer's submission failed while Redis restarted). Here the check is retried as a command is; the connect
    before it is not (``_Unreached``)."""

    def ensure_connection(self, connection: Any) -> None:
        retry, check = self.connection_kwargs.get("retry"), super().ensure_connection
        if retry is None:
            return check(connection)

        def once() -> None:
            try:
                connection.connect()
            except (redis.ConnectionError, redis.TimeoutError) as error:
                raise _Unreached(error) from error
            check(connection)

        try:
            return retry.call_with_retry(once, lambda _: None)
        except _Unreached as unreached:
            raise unreached.error from None


class _AsyncPool(aioredis.BlockingConnectionPool):
    """``_Pool`` for the asyncio client; and a call finding every connection in use waits for one (up to
    ``timeout``) rather than failing: a worker taking in a backlog looks each planned request up at once, and past
    redis-py's 100 connections the rest failed with "Too many connections" and were retried as if Redis were
    down (logged and counted as unreachable; every gate run's worker did so at its backlog). One that waits in
    vain raises ``PoolFull``, naming the pool's size, not redis-py's "No connection available." (read as Redis
    down: a plain 503 and a Redis failure counted)."""

    def __init__(self, max_connections: int = 100, timeout: float | None = 20, **options: Any) -> None:
        super().__init__(max_connections=max_connections, timeout=timeout, **options)

    async def get_connection(self, *args: Any, **options: Any) -> Any:
        try:
            return await super().get_connection(*args, **options)
        except redis.ConnectionError as error:  # redis-py's "No connection available.": its wait timed out
            if isinstance(error.__cause__, asyncio.TimeoutError) and "No connection available" in str(error):
                raise PoolFull(self.max_connections, self.timeout or 0.0) from error
            raise

    async def ensure_connection(self, connection: Any) -> None:
        retry, check = self.connection_kwargs.get("retry"), super().ensure_connection
        if retry is None:
            return await check(connection)

        async def once() -> None:
            try:
                await connection.connect()
            except (redis.ConnectionError, redis.TimeoutError) as error:
                raise _Unreached(error) from error
            await check(connection)

        try:
            return await retry.call_with_retry(once, _async_nothing)
        except _Unreached as unreached:
            raise unreached.error from None


class PoolFull(redis.ConnectionError):
    """Every connection of a client's pool stayed in use for the pool's whole wait: the process's own calls
    hold them all (too many at once, or some stuck), not Redis down. A ConnectionError still, so that every
    caller retries or refuses it as before; counted apart (``dq_redis_pool_timeouts_total``,
    ``dq_gateway_redis_pool_timeouts_total``)."""

    def __init__(self, size: int, waited: float) -> None:
        super().__init__(f"the Redis connection pool is full: all {size} connections stayed in use for "
                         f"{waited:g} s (this process's own calls hold them; Redis itself may be fine)")
        self.size, self.waited = size, waited


class _Unreached(Exception):
    """A connect that failed after its own retries (redis-py's ``connect`` retries with the connection's
    ``retry``): final, never retried again by the check's retry. Retried, each of the check's attempts ran all
    of connect's: a Redis that is down took a call 17 x 17 attempts (about 4 minutes) to fail, not ~12 s."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


async def _async_nothing(_: BaseException) -> None:
    return None


def connect(url: str, cluster: bool = False, **options: Any) -> Any:
    """A synchronous client (rediss:// URLs give TLS; a Sentinel URL, a client of the service's primary)."""
    chosen = _options(Retry, options)
    if sentinel.is_sentinel(url):
        return sentinel.master(url, chosen)
    if cluster:
        return redis.RedisCluster.from_url(url, **chosen)
    single = chosen.pop("single_connection_client", False)
    client = redis.Redis(connection_pool=_Pool.from_url(url, **chosen), single_connection_client=single)
    client.auto_close_connection_pool = True  # as redis.Redis.from_url's: closing the client closes its pool
    return client


def aconnect(url: str, cluster: bool = False, **options: Any) -> Any:
    """An asyncio client, as ``connect``."""
    chosen = _options(AsyncRetry, options)
    if sentinel.is_sentinel(url):
        return sentinel.master(url, chosen, asyncio=True)
    if cluster:
        return aioredis.RedisCluster.from_url(url, **chosen)
    single = chosen.pop("single_connection_client", False)
    client = aioredis.Redis(connection_pool=_AsyncPool.from_url(url, **chosen), single_connection_client=single)
    client.auto_close_connection_pool = True
    return client


def is_cluster(client: Any) -> bool:
    """Whether ``client`` (blocking or asyncio) is a Redis Cluster client."""
    return isinstance(client, (redis.RedisCluster, aioredis.RedisCluster))


def check_reachable(deployment: Deployment, **options: Any) -> None:
    """One PING without retries, so that a wrong URL fails within the socket timeout instead of after the ~12
    s of retries meant for a restarting Redis. Raises a ``redis.RedisError`` (or ValueError for a malformed
    URL)."""
    client = connect(deployment.url, deployment.cluster, **{**deployment.options(), **options,
                                                             "retry": Retry(NoBackoff(), 0)})
    try:
        client.ping()
    finally:
        client.close()
