"""The function library (producer/wire/library.py) on a real server: the submit function's admission (request streams
only, ids, body sizes, batch size, backpressure, all or nothing), and ``ensure``: loaded when missing, an older
revision replaced, a newer one never, persisted by AOF, refused clearly where the user may not load it
(producer/plumbing/library_loader.py)."""

import asyncio

import pytest
import redis

from producer.client import AsyncClient, Client, LibraryUnavailable
from producer.plumbing import library_loader
from producer.wire import library
from producer.wire.keys import MAX_BODY_BYTES, Keys
from test_e2e import QUESTIONS

pytestmark = pytest.mark.redis
KEYS = Keys()


@pytest.fixture
def admin(redis_server):
    client = redis.Redis(port=redis_server.port)
    library_loader.ensure(client)
    return client


def submit(client: redis.Redis, *args, stream: str = KEYS.requests):
    return client.fcall(library.SUBMIT, 1, stream, *args)


def error_of(call, *args, **kwargs) -> str:
    with pytest.raises(redis.ResponseError) as raised:
        call(*args, **kwargs)
    return str(raised.value)


@pytest.mark.parametrize("request_id, ok", [
    ("", True), ("ticket-42", True), ("a.b_c:d-E9", True), ("x" * 128, True), ("1-", True), ("-1", True),
    ("x" * 129, False), ("x\n", False), ("a b", False), ("{x}", False), ("é", False), ("1-1", False),
    ("18446744073709551615-18446744073709551615", False), ("0-0", False)])
def test_submit_checks_each_id(admin, request_id, ok):
    if ok:
        [entry_id] = submit(admin, 0, request_id, "{}")
        assert admin.xrange(KEYS.requests)[-1] == (entry_id, {b"body": b"{}"})
    else:
        assert "stream entry id" in error_of(submit, admin, 0, request_id, "{}")
        assert admin.xlen(KEYS.requests) == 0


def test_submit_refuses_bad_calls_whole(admin):
    admin.xadd(KEYS.requests, {"body": "{}"})
    for args, why in [((0, "ok", "{}", "bad\n", "{}"), "request 2: the id"),  # all or nothing
                      ((0, "ok", ""), "request 1: the body is 0 bytes"),
                      ((0, "big", "x" * (MAX_BODY_BYTES + 1)), f"not 1 to {MAX_BODY_BYTES}"),
                      ((0, "a", "{}", "b"), "expected: limit"), ((0,), "expected: limit"),
                      (("none", "a", "{}"), "expected: limit"), ((-1, "a", "{}"), "expected: limit"),
                      ((0, *["a", "{}"] * (library.MAX_BATCH + 1)), "expected: limit")]:
        assert why in error_of(submit, admin, *args)
    for stream in (KEYS.parts, KEYS.dead, KEYS.result("x"), KEYS.reply_prefix + "x", "elsewhere",
                   KEYS.requests + "x", Keys("dq", "x").requests):
        assert "not a request stream" in error_of(submit, admin, 0, "a", "{}", stream=stream)
        assert not admin.exists(stream)
    assert admin.xlen(KEYS.requests) == 1


def test_submit_backpressure_is_all_or_nothing_and_ids_come_back_in_order(admin):
    ids = submit(admin, 3, "a", '{"n": 1}', "b", '{"n": 2}', stream=Keys("other:ns", 7).requests)
    assert [fields[b"body"] for _, fields in admin.xrange(Keys("other:ns", 7).requests)] == [b'{"n": 1}', b'{"n": 2}']
    assert [entry_id for entry_id, _ in admin.xrange(Keys("other:ns", 7).requests)] == ids
    assert "QUEUEFULL 2 unfinished entries, limit 3" in error_of(submit, admin, 3, "c", "{}", "d", "{}",
                                                                 stream=Keys("other:ns", 7).requests)
    assert admin.xlen(Keys("other:ns", 7).requests) == 2
    assert len(submit(admin, 0, *["x", "{}"] * library.MAX_BATCH)) == library.MAX_BATCH  # 0: no limit


def test_ensure_loads_replaces_older_never_newer(redis_server):
    client = redis.Redis(port=redis_server.port)
    assert library_loader.ensure(client) == library.Loaded(library.REVISION, "loaded")
    assert library_loader.ensure(client) == library.Loaded(library.REVISION, "present")
    older = library.CODE.replace(f"local REVISION = {library.REVISION}", "local REVISION = 0")
    client.function_load(older, replace=True)
    assert library_loader.ensure(client, replace_older=False) == library.Loaded(0, "present")  # a producer leaves it
    assert library_loader.ensure(client) == library.Loaded(library.REVISION, "replaced")  # a worker replaces it
    newer = library.CODE.replace(f"local REVISION = {library.REVISION}", "local REVISION = 999")
    client.function_load(newer, replace=True)
    assert library_loader.ensure(client) == library.Loaded(999, "present")
    assert client.fcall(library.REVISION_FUNCTION, 0) == 999


def test_ensure_when_another_client_loads_it_first(redis_server):
    client = redis.Redis(port=redis_server.port)

    class Racing:  # another worker's load lands between this one's look and its load
        def execute_command(self, *words, **options):
            if words[0] == "FUNCTION LOAD":
                library_loader.ensure(client)
            return client.execute_command(*words, **options)

    assert library_loader.ensure(Racing()) == library.Loaded(library.REVISION, "present")


def test_the_library_persists_in_the_aof_and_is_gone_with_the_data(redis_server):
    client = redis.Redis(port=redis_server.port)
    library_loader.ensure(client)
    redis_server.stop(kill=True)
    redis_server.start()
    assert client.fcall(library.REVISION_FUNCTION, 0) == library.REVISION
    redis_server.stop()
    redis_server.wipe()
    redis_server.start()
    assert library.missing(pytest.raises(redis.ResponseError, client.fcall, library.REVISION_FUNCTION, 0).value)


def test_producers_load_it_on_a_server_without_it_unless_they_may_not(redis_server):
    client = redis.Redis(port=redis_server.port)
    Client(redis_server.url).submit({"id": "first", "state": "x", "questions": QUESTIONS})
    client.function_flush()

    async def first():
        async with AsyncClient(redis_server.url) as producer:
            return await producer.submit({"id": "again", "state": "x", "questions": QUESTIONS})

    assert asyncio.run(first()) == "again" and client.xlen(KEYS.requests) == 2
    client.function_flush()
    client.execute_command("ACL", "SETUSER", "p", "on", ">pw", "resetkeys", "-@all", "+fcall", "+xadd", "+xlen",
                           "+ping", "+hello", "+client|setname", "~*")
    with pytest.raises(LibraryUnavailable, match="missing on this server and this user may not load it"):
        Client(f"redis://p:pw@127.0.0.1:{redis_server.port}/0").submit({"state": "x", "questions": QUESTIONS})
    assert client.xlen(KEYS.requests) == 2


def test_invalid_from_the_function_is_invalid_request_for_the_client(admin, redis_server):
    from producer.client import InvalidRequest, Prepared

    with pytest.raises(InvalidRequest, match="request 1: the id"):
        Client(redis_server.url).submit(Prepared("1-1", "{}"))  # a Prepared skips the client's own checks

