"""The Python client (producer/client/) against a real redis-server: submit, backpressure, wait without polling, fetch
again."""

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from producer.client import AsyncClient, Client, InvalidRequest, QueueFull, ResultTimeout
from producer.client.plans import prepare
from producer.wire.keys import Keys, shard_of
from producer.wire.result import Result

ROOT = Path(__file__).resolve().parents[2]
REQUEST = {"state": "hello", "questions": {"q": {"type": "noul", "instructions": "ok?"}}}


DIGEST = prepare(REQUEST).digest  # what REQUEST asks, whatever its id: every result of it carries this


def publish(client: Client, request_id: str, status: str = "ok") -> None:
    """What a worker does for a request (REQUEST under ``request_id``): one entry on its result stream."""
    body = json.dumps({"id": request_id, "status": status, "answers": {"q": {"type": "noul", "noul": 0.5}},
                       "digest": DIGEST})
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


def test_a_wait_with_no_live_worker_ends_early_and_says_why(redis_server):
    """Client(namespace="typo") waited its whole timeout in silence: now, with no worker of the namespace alive
    for the whole wait, it ends after no_worker_s (15 s by default), naming the namespace; a shorter timeout ends
    on time with the same hint; with a worker alive (a fresh heartbeat) it waits its whole timeout, and says
    nothing of workers."""
    assert Client(redis_server.url).core.no_worker_s == 15.0
    typo = Client(redis_server.url, namespace="typo", no_worker_s=1.5)
    request_id = typo.submit(REQUEST)
    started = time.monotonic()
    with pytest.raises(ResultTimeout, match="no live worker in namespace 'typo'") as early:
        typo.wait(request_id, timeout=60)
    assert 1.5 <= time.monotonic() - started < 10 and early.value.no_worker == "typo"
    assert early.value.missing == [request_id] and "1 of 1 results not there yet" in str(early.value)
    with pytest.raises(ResultTimeout, match="no live worker in namespace 'typo'") as short:
        Client(redis_server.url, namespace="typo").wait(request_id, timeout=0.3)
    assert short.value.no_worker == "typo"

    async def awaited():
        async with AsyncClient(redis_server.url, namespace="typo", no_worker_s=1.5) as client:
            return await client.decide(REQUEST, timeout=60)

    started = time.monotonic()
    with pytest.raises(ResultTimeout, match="no live worker") as through_decide:
        asyncio.run(awaited())
    assert time.monotonic() - started < 10 and through_decide.value.no_worker == "typo"

    alive = Client(redis_server.url, no_worker_s=1.0)
    alive.redis.hset(alive.keys.workers(), "w-1", json.dumps({"ts": time.time(), "inflight": 0}))
    request_id = alive.submit(REQUEST)
    started = time.monotonic()
    with pytest.raises(ResultTimeout) as full:
        alive.wait(request_id, timeout=3)
    assert time.monotonic() - started >= 3 and full.value.no_worker is None and "worker" not in str(full.value)
    patient = Client(redis_server.url, namespace="typo", no_worker_s=None)
    started = time.monotonic()
    with pytest.raises(ResultTimeout) as whole:
        patient.wait(request_id, timeout=2.5)
    assert time.monotonic() - started >= 2.5 and whole.value.no_worker is None


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


def test_queue_full_says_which_requests_went_in(redis_server):
    """1000 requests without ids over a limit of 600: the first batch goes in, and its ids are not lost."""
    client = Client(redis_server.url, max_unfinished=600)
    with pytest.raises(QueueFull, match="shard 0, normal lane: 500 unfinished entries, limit 600; 500 of 1000") as full:
        client.submit_many([REQUEST] * 1000)
    accepted, refused = full.value.accepted, full.value.refused
    assert len(accepted) == 500 and len(refused) == 500 and not set(accepted) & set(refused)
    queued = [json.loads(fields[b"body"])["id"] for _, fields in client.redis.xrange(client.keys.requests)]
    assert queued == accepted  # exactly those, in order
    # Batches never exceed the limit, so a limit below 500 does not refuse a batch the empty stream could take.
    small = Client(redis_server.url, namespace="small", max_unfinished=3)
    with pytest.raises(QueueFull) as full:
        small.submit_many([REQUEST] * 5)
    assert len(full.value.accepted) == 3 and len(full.value.refused) == 2


def test_an_invalid_request_is_named_by_its_position_and_nothing_is_sent(redis_server):
    client = Client(redis_server.url)
    with pytest.raises(InvalidRequest, match=r"request 2: metadata: .* over the 4096-byte limit") as error:
        client.submit_many([REQUEST, REQUEST, {**REQUEST, "metadata": {"blob": "x" * 5000}}])
    assert error.value.index == 2 and client.redis.xlen(client.keys.requests) == 0


def test_a_result_from_a_newer_worker_with_extra_fields_is_read(redis_server):
    client = Client(redis_server.url)
    request_id = client.submit(REQUEST)
    body = {"id": request_id, "status": "ok", "answers": {"q": {"type": "noul", "noul": 0.8}},
            "probabilities": {"q": [0.8, 0.2]}, "options": {"q": ["true", "false"]},
            "usage": {"tokens": 5, "prompts": 1, "parts": 1, "kv_cache_hits": 3},
            "timings": {"enqueued_ms": 1, "finished_ms": 2, "gpu": "h200"}, "explanations": {"q": "because"},
            "digest": DIGEST}
    client.redis.xadd(client.keys.result(request_id), {"body": json.dumps(body)})
    result = client.wait_many([request_id], timeout=5)[request_id]
    assert result.option_probabilities == {"q": {"true": 0.8, "false": 0.2}}
    assert result.model_extra == {"explanations": {"q": "because"}}
    assert result.usage.model_extra == {"kv_cache_hits": 3} and result.timings.model_extra == {"gpu": "h200"}


def test_a_result_for_another_id_or_no_result_at_all_is_never_handed_out(redis_server):
    """A result stream holding a result of another id (no worker writes one; a reply stream pointed at another
    request's result stream did), or no result at all (garbage, an entry without a body), is that id's id_conflict,
    saying why: never an answer, and never an error that takes the other ids of the same read down with it."""
    client = Client(redis_server.url)
    publish(client, "mine")
    client.redis.xadd(client.keys.result("victim"), {"body": json.dumps({"id": "attacker", "status": "ok",
                                                                           "answers": {"q": {"noul": 1.0}}})})
    client.redis.xadd(client.keys.result("garbage"), {"body": b"\xff{not json"})
    client.redis.xadd(client.keys.result("bodiless"), {"other": "x"})
    assert client.wait("mine", timeout=5).id == "mine"
    whys = {"victim": "holds a result for 'attacker'", "garbage": "holds no readable result",
            "bodiless": "holds an entry without a body"}
    for request_id, why in whys.items():
        for result in (client.fetch(request_id), client.wait(request_id, timeout=5),
                       client.wait_many(["mine", request_id], timeout=5)[request_id]):
            assert result.id == request_id and result.error.code == "id_conflict" and why in result.error.message
            assert result.answers is None and not result.ok
        assert client.wait_many(["mine", request_id], timeout=5)["mine"].ok

    async def run():
        async with AsyncClient(redis_server.url) as aclient:
            return await aclient.wait("victim", timeout=5)

    assert asyncio.run(run()).error.code == "id_conflict"



def test_a_stored_result_of_another_request_under_a_reused_id_is_read_as_id_conflict(redis_server):
    """submit_many then wait_many (the README's way) handed out the stored answer of another request that had used
    the id before, as ok: the client now checks what it reads against what it submitted."""
    client = Client(redis_server.url)
    mine = prepare({**REQUEST, "id": "reused"})
    theirs = {"id": "reused", "status": "ok", "answers": {"q": {"noul": 1.0}}, "digest": "0" * 32}
    client.redis.xadd(client.keys.result("reused"), {"body": json.dumps(theirs)})
    client.submit_many([mine])
    for result in (client.wait_many(["reused"], timeout=5)["reused"], client.wait("reused", timeout=5),
                   client.fetch("reused")):
        assert result.error.code == "id_conflict" and result.digest == mine.digest
    assert Client(redis_server.url).fetch("reused").ok  # a reader that did not submit it sees what is stored
    again = prepare({**REQUEST, "id": "same"})
    client.redis.xadd(client.keys.result("same"), {"body": json.dumps({**theirs, "id": "same",
                                                                       "digest": again.digest})})
    client.submit_many([again])
    assert client.wait_many(["same"], timeout=5)["same"].ok  # the same request: its stored result

def test_wait_many_timeout_carries_what_landed(redis_server):
    client = Client(redis_server.url)
    ids = client.submit_many([REQUEST] * 3)
    publish(client, ids[1])
    with pytest.raises(ResultTimeout, match="2 of 3") as late:
        client.wait_many(ids, timeout=0.3)
    assert list(late.value.results) == [ids[1]] and late.value.missing == [ids[0], ids[2]]


def test_async_client_has_every_method_of_client(redis_server):
    import inspect

    def public(cls):
        return {name: list(inspect.signature(member).parameters) for name, member in inspect.getmembers(cls)
                if callable(member) and not name.startswith("_")}

    assert public(AsyncClient) == public(Client)

    async def scenario():
        async with AsyncClient(redis_server.url, shards=2) as client:
            ids = await client.submit_many([{**REQUEST, "id": f"a-{i}"} for i in range(6)])
            stats = await client.stats()
            assert stats["requests"]["length"] == 6 and [s["shard"] for s in stats["shards"]] == [0, 1]
            asyncio.get_running_loop().call_later(0.2, publish, Client(redis_server.url), "a-decided")
            decided = await client.decide({**REQUEST, "id": "a-decided"}, timeout=10)
            assert decided.ok and decided.id == "a-decided"
            return ids
    assert asyncio.run(scenario()) == [f"a-{i}" for i in range(6)]


def test_shards_spread_requests_and_stats_show_each(redis_server):
    client = Client(redis_server.url, shards=3)
    ids = client.submit_many([{**REQUEST, "id": f"s-{i}"} for i in range(30)])
    for shard in range(3):
        stream = Keys("dq", shard).requests
        queued = [json.loads(fields[b"body"])["id"] for _, fields in client.redis.xrange(stream)]
        assert queued == [r for r in ids if shard_of(r, 3) == shard] and queued  # each shard got its own
    stats = client.stats()
    assert [s["requests"]["length"] for s in stats["shards"]] == [len([r for r in ids if shard_of(r, 3) == s])
                                                                  for s in range(3)]
    assert stats["requests"] == {"length": 30} and stats["dead_letters"] == 0 and stats["workers"] == 0


def test_the_client_reads_the_workers_environment(redis_server, monkeypatch):
    monkeypatch.setenv("DQ_REDIS_URL", redis_server.url)
    monkeypatch.setenv("DQ_NAMESPACE", "envns")
    monkeypatch.setenv("DQ_SHARDS", "2")
    client = Client()
    assert (client.keys.namespace, client.shards) == ("envns", 2)
    client.submit({**REQUEST, "id": "env-1"})
    assert client.redis.xlen(Keys("envns", shard_of("env-1", 2)).requests) == 1


@pytest.mark.slow
def test_the_readme_python_snippet_runs_as_written(served):
    """The README's snippet, verbatim, against a real worker (its Client() reads DQ_REDIS_URL)."""
    readme = (ROOT / "README.md").read_text()
    snippet = readme.split("## Sending requests", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    done = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "DQ_REDIS_URL": served.url})
    assert done.returncode == 0, done.stderr
    first, *rest, status, cancel = done.stdout.splitlines()
    refund, calm = map(float, first.split())
    assert 0 <= refund <= 1 and 0 <= calm <= 1
    assert [line.split(" ", 1)[0] for line in rest] == ["ticket-0", "ticket-1"]
    assert all(line.split(" ", 1)[1].startswith("{'true': ") for line in rest)
    assert all(line.endswith("} {'tenant': 'acme'}") for line in rest)  # the metadata, echoed
    # the last request's status, then its cancel: wherever the worker had it by then
    assert re.search(r": Status\(id='[0-9a-f]{32}', state='(queued|in_progress|answered)'", status), status
    assert re.search(r": Cancel\(id='[0-9a-f]{32}', state='(cancelled|cancelling|too_late)'", cancel), cancel


def test_callers_sharing_a_client_are_each_told_of_their_own_request(redis_server, inprocess):
    """Two callers of one AsyncClient decide two requests under one id at once: the one whose request was answered
    gets its answer, the other id_conflict (the client's memory of the id holds only the last; decide checks its
    own request)."""
    inprocess(redis_server.url).start()

    async def both():
        async with AsyncClient(redis_server.url) as client:
            first = asyncio.ensure_future(client.decide({**REQUEST, "id": "shared-1", "state": "one"}, timeout=60))
            await asyncio.sleep(0)
            second = asyncio.ensure_future(client.decide({**REQUEST, "id": "shared-1", "state": "two"}, timeout=60))
            return await first, await second

    results = asyncio.run(both())
    assert sorted(r.error.code if r.error else r.status for r in results) == ["id_conflict", "ok"]


def test_durable_mode_refuses_a_full_queue_as_queue_full(redis_server):
    """Durable mode on one Redis sends a submit and its WAIT in one pipeline: a full queue is QueueFull there too,
    naming what went in (before, the pipeline's refusal came back as a bare ResponseError whose text redis-py had
    prefixed with the command, request bodies and all)."""
    client = Client(redis_server.url, max_unfinished=1, wait_replicas=1)
    client.redis.xadd(client.keys.requests, {"body": "{}"})  # one unfinished entry: the limit is reached
    with pytest.raises(QueueFull, match="shard 0, normal lane: 1 unfinished entries, limit 1") as full:
        client.submit_many([{**REQUEST, "id": "durable-full"}])
    assert full.value.refused == ["durable-full"] and "durable-full" not in str(full.value)
