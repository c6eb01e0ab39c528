"""The producer against a real redis-server: submit, backpressure, wait without polling, fetch again."""

import asyncio
import json
import threading
import time

import pytest

from producer.client import AsyncClient, Client, InvalidRequest, QueueFull, ResultTimeout
from producer.keys import Keys
from producer.schema import Result

REQUEST = {"state": "hello", "questions": {"q": {"type": "noul", "instructions": "ok?"}}}


def publish(client: Client, request_id: str, status: str = "ok") -> None:
    """What a worker does for a request: one entry on its result stream."""
    body = json.dumps({"id": request_id, "status": status, "answers": {"q": {"type": "noul", "noul": 0.5}}})
    client.redis.xadd(client.keys.result(request_id), {"body": body})


def test_submit_assigns_ids_and_writes_json_entries(redis_server):
    client = Client(redis_server.url)
    given = client.submit({**REQUEST, "id": "mine-1"})
    generated = client.submit(REQUEST)
    assert given == "mine-1" and len(generated) == 32
    entries = client.redis.xrange(client.keys.requests)
    bodies = [json.loads(fields[b"body"]) for _, fields in entries]
    assert [b["id"] for b in bodies] == ["mine-1", generated]
    assert bodies[0]["questions"] == REQUEST["questions"]


def test_invalid_requests_are_refused_before_sending(redis_server):
    client = Client(redis_server.url)
    with pytest.raises(InvalidRequest, match="questions"):
        client.submit({"state": "x", "questions": {}})
    assert client.redis.xlen(client.keys.requests) == 0


def test_backpressure_refuses_whole_batches(redis_server):
    client = Client(redis_server.url, max_unfinished=5)
    client.submit_many([REQUEST] * 4)
    with pytest.raises(QueueFull, match="4 unfinished entries, limit 5"):
        client.submit_many([REQUEST] * 2)
    assert client.redis.xlen(client.keys.requests) == 4  # nothing of the refused batch went in
    client.submit(REQUEST)
    with pytest.raises(QueueFull):
        client.submit(REQUEST)
    assert Client(redis_server.url, max_unfinished=0).submit(REQUEST)  # 0: no limit


def test_wait_blocks_until_the_result_lands_and_it_can_be_read_again(redis_server):
    client = Client(redis_server.url)
    request_id = client.submit(REQUEST)
    with pytest.raises(ResultTimeout):
        client.wait(request_id, timeout=0.2)
    threading.Timer(0.3, publish, (Client(redis_server.url), request_id)).start()
    start = time.monotonic()
    result = client.wait(request_id, timeout=10)
    assert isinstance(result, Result) and result.id == request_id and result.ok
    assert time.monotonic() - start < 2  # woken by the entry, not by a poll interval
    assert client.fetch(request_id) == result  # still there for a late reader
    assert client.wait(request_id, timeout=1) == result


def test_wait_many_returns_results_published_before_and_after(redis_server):
    client = Client(redis_server.url)
    ids = client.submit_many([REQUEST] * 6)
    for request_id in ids[:3]:
        publish(client, request_id)
    threading.Timer(0.2, lambda: [publish(Client(redis_server.url), r) for r in ids[3:]]).start()
    results = client.wait_many(ids, timeout=10)
    assert sorted(results) == sorted(ids)
    with pytest.raises(ResultTimeout, match="1 of 1"):
        client.wait_many(["never-submitted"], timeout=0.3)


def test_async_client(redis_server):
    async def scenario():
        async with AsyncClient(redis_server.url, max_unfinished=3) as client:
            ids = await client.submit_many([REQUEST] * 3)
            with pytest.raises(QueueFull):
                await client.submit(REQUEST)
            sync = Client(redis_server.url)
            asyncio.get_running_loop().call_later(0.2, lambda: [publish(sync, r) for r in ids])
            results = await client.wait_many(ids, timeout=10)
            assert [results[r].id for r in ids] == ids
            assert (await client.fetch(ids[0])).ok
    asyncio.run(scenario())


def test_stats_on_an_empty_and_a_busy_queue(redis_server):
    client = Client(redis_server.url)
    assert client.stats()["requests"]["length"] == 0
    client.submit_many([REQUEST] * 3)
    client.redis.xgroup_create(client.keys.requests, Keys().group, id="0", mkstream=True)
    client.redis.xreadgroup(Keys().group, "someone", {client.keys.requests: ">"}, count=2)
    stats = client.stats()
    assert stats["requests"] == {"length": 3, "pending": 2, "lag": 1, "consumers": 1}
    assert stats["dead_letters"] == 0


def test_waiting_on_many_results_reads_each_once(redis_server):
    """Results landing in any order over more streams than one read window; no re-polling per round."""
    client = Client(redis_server.url)
    ids = client.submit_many([REQUEST] * 300)
    client.redis.config_resetstat()
    publisher = Client(redis_server.url)
    threading.Timer(0.2, lambda: [publish(publisher, r) for r in reversed(ids)]).start()
    results = client.wait_many(ids, timeout=30)
    assert list(results) == ids and all(results[r].id == r for r in ids)
    calls = client.redis.info("commandstats")
    assert calls.get("cmdstat_xrange", {}).get("calls", 0) <= len(ids)  # one look before blocking, then XREADs
