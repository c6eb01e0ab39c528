"""Property tests of result aggregation: the real functions (producer/wire/library.py: part, then publish) through the
real Publisher, against a real redis-server, over random part orders, duplicates, batchings and two workers
settling at the same time. Whatever the order: one publication, every question once, nothing left behind."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer.client import aconnect
from producer.local.server import RedisServer
from producer.plumbing import library_loader
from producer.wire import library
from producer.wire.keys import Keys
from producer.wire.result import Result
from worker.entries import PARTS, REQUESTS, Delivery
from worker.loop.publisher import Publisher
from worker.outcomes import Outcome, Share

pytestmark = pytest.mark.redis

TTL = 600
_examples = itertools.count()


@pytest.fixture(scope="module")
def server():
    with RedisServer(appendonly=False) as server:
        library_loader.ensure(redis.Redis(port=server.port))  # what a worker does at start
        yield server


def share(index: int, names: list[str]) -> Share:
    """A part's share of the result, as a worker computes it; marked with its part index."""
    return Share(answers={n: {"type": "noul", "noul": 0.5, "part": index} for n in names},
                 logits={n: [float(index), 0.0] for n in names}, probabilities={n: [0.5, 0.5] for n in names},
                 options={n: ["true", "false"] for n in names}, tokens=10 + index, prompts=1, compute_ms=1.5,
                 started_ms=1000 + index)


@st.composite
def scenarios(draw):
    """Parts of one request, the deliveries of each (every part at least once, some more), in a random order,
    split between two workers that each settle their deliveries in random batches."""
    parts = draw(st.integers(2, 5))
    sizes = draw(st.lists(st.integers(1, 3), min_size=parts, max_size=parts))
    extra = draw(st.lists(st.integers(0, parts - 1), max_size=6))
    order = draw(st.permutations(list(range(parts)) + extra))
    owner = draw(st.lists(st.integers(0, 1), min_size=len(order), max_size=len(order)))
    cuts = [draw(st.lists(st.integers(1, 4), min_size=len(order), max_size=len(order))) for _ in range(2)]
    return sizes, order, owner, cuts


def batches(items: list, cuts: list[int]) -> list[list]:
    out, at = [], 0
    for size in cuts:
        if at >= len(items):
            break
        out.append(items[at: at + size])
        at += size
    return out


async def deliver(r, keys: Keys, consumer: str, fields: dict) -> Delivery:
    """A real prompt-stream entry taken by ``consumer``, so that acknowledging it is checked too."""
    await r.xadd(keys.parts, fields)
    [[_, [(entry_id, got)]]] = await r.xreadgroup(keys.group, consumer, {keys.parts: ">"}, count=1)
    return Delivery.parse(PARTS, keys.parts, entry_id.decode(), got, 1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scenarios())
def test_parts_in_any_order_and_any_number_of_times_publish_one_complete_result(server, scenario):
    sizes, order, owner, cuts = scenario
    keys = Keys(f"agg{next(_examples)}")
    names = [[f"p{i}q{k}" for k in range(size)] for i, size in enumerate(sizes)]
    question_order = [n for group in names for n in group]
    request_id = "req"

    async def run():
        workers = [aconnect(server.url), aconnect(server.url)]
        r = workers[0]
        await r.xgroup_create(keys.parts, keys.group, id="0", mkstream=True)
        await r.set(keys.body(request_id), "{}")  # what a fan-out stores; publication deletes it
        outcomes: list[list[Outcome]] = [[], []]
        for index, who in zip(order, owner):
            d = await deliver(r, keys, f"w{who}", {"request_id": request_id, "part": index, "parts": len(sizes),
                                                   "questions": json.dumps(names[index]), "enqueued_ms": 0})
            assert d.invalid is None and (d.request_id, d.part, d.parts) == (request_id, index, len(sizes))
            outcomes[who].append(Outcome(d, d.identity, share=share(index, names[index]), part=index,
                                         parts=len(sizes), order=question_order))

        async def settle(who: int) -> list:
            publisher = Publisher(workers[who], keys, TTL, "tiny")
            done = []
            for group in batches(outcomes[who], cuts[who]):
                done += (await publisher.settle(group)).settled
            return done

        done = sum(await asyncio.gather(settle(0), settle(1)), [])
        for w in workers:
            await w.aclose()
        return done

    done = asyncio.run(run())
    assert sum(1 for _, result, published in done if published) == 1  # one publication, whoever completed it
    sync = redis.Redis.from_url(server.url)
    [(_, fields)] = sync.xrange(keys.result(request_id))  # exactly one entry
    result = Result.model_validate_json(fields[b"body"])
    assert result.ok and list(result.answers) == question_order  # every question once, in request order
    assert all(result.answers[n]["part"] == i for i, group in enumerate(names) for n in group)
    assert result.usage.parts == len(sizes)
    assert result.usage.tokens == sum(10 + i for i in range(len(sizes)))  # a duplicate part counts once
    assert not sync.exists(keys.shares(request_id), keys.body(request_id))
    assert sync.xlen(keys.parts) == 0 and sync.xpending(keys.parts, keys.group)["pending"] == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 1), st.sampled_from(["ok", "error"])), min_size=1, max_size=8),
       st.lists(st.integers(1, 3), min_size=8, max_size=8))
def test_whole_results_published_several_times_keep_the_first(server, publications, cuts):
    """A request processed twice (redelivered, or enqueued twice): the first stored result stays, alone."""
    keys = Keys(f"pub{next(_examples)}")
    request_id = "once"

    def result(n: int, status: str) -> Result:
        if status == "ok":
            return Result(id=request_id, status="ok", answers={"q": {"n": n}})
        return Result.model_validate({"id": request_id, "status": "error",
                                      "error": {"code": "internal_error", "message": f"attempt {n}"}})

    async def run():
        workers = [aconnect(server.url), aconnect(server.url)]
        await workers[0].xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
        outcomes: list[list[Outcome]] = [[], []]
        for n, (who, status) in enumerate(publications):
            body = json.dumps({"id": request_id})
            entry_id = (await workers[0].xadd(keys.requests, {"body": body})).decode()
            d = Delivery.parse(REQUESTS, keys.requests, entry_id, {b"body": body.encode()}, 1)
            outcomes[who].append(Outcome(d, d.identity, result=result(n, status)))

        async def settle(who: int) -> list:
            publisher = Publisher(workers[who], keys, TTL, "tiny")
            return sum([(await publisher.settle(b)).settled for b in batches(outcomes[who], cuts)], [])

        done = sum(await asyncio.gather(settle(0), settle(1)), [])
        for w in workers:
            await w.aclose()
        return done

    done = asyncio.run(run())
    winners = [result for _, result, published in done if published]
    assert len(winners) == 1
    [(_, fields)] = redis.Redis.from_url(server.url).xrange(keys.result(request_id))
    assert json.loads(fields[b"body"]) == json.loads(winners[0].model_dump_json(exclude_none=True))
    assert redis.Redis.from_url(server.url).xlen(keys.requests) == 0
