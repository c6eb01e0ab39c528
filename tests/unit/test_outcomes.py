"""How an entry ends, as plain data (worker/outcomes.py): a part's share survives its trip through Redis as JSON;
parts merge into one result in the request's question order, each counted once; error results go where the
request's identity says. And the lifecycle counts a result before it lets its entry go (tests wait on
``dq_inflight_entries == 0`` and then compare the counters; counted after the release, a scrape could fall in
between)."""

import asyncio

from producer.wire.keys import Keys
from producer.wire.schema import ErrorCode
from worker.config import Settings
from worker.entries import REQUESTS, Delivery, Identity
from worker.loop.held import HeldEntries
from worker.loop.redis_calls import RedisCalls
from worker.loop.settler import Settler
from worker.metrics import Metrics
from worker.outcomes import Outcome, Share, error_outcome, ok_result

KEYS = Keys("dq")
ME = Identity("r-1", KEYS.reply_prefix + "me", {"tenant": "acme"}, "00-" + "a" * 32 + "-" + "b" * 16 + "-01")


def share(names: list[str], tokens: int, started_ms: int) -> Share:
    return Share(answers={n: {"type": "noul", "noul": 0.5, "of": tokens} for n in names},
                 logits={n: [1.0, -1.0] for n in names}, probabilities={n: [0.5, 0.5] for n in names},
                 options={n: ["true", "false"] for n in names}, tokens=tokens, prompts=1, compute_ms=1.25,
                 started_ms=started_ms)


def delivery(n: int = 0) -> Delivery:
    return Delivery.parse(REQUESTS, KEYS.requests, f"1700000000000-{n}", {b"body": b'{"id": "r-1"}'}, 1)


def test_a_share_round_trips_through_json():
    one = share(["a", "b"], 12, 1000)
    assert Share.from_json(one.to_json()) == one


def test_parts_merge_in_the_requests_question_order_and_their_usage_adds_up():
    outcome = Outcome(delivery(), ME, share=share(["c"], 7, 2000), part=1, parts=2, order=["a", "b", "c"])
    outcome.merge([share(["c"], 7, 2000), share(["a", "b"], 10, 1500)], "tiny")
    result = outcome.result
    assert outcome.share is None and result.ok and list(result.answers) == ["a", "b", "c"]
    assert [result.answers[n]["of"] for n in "abc"] == [10, 10, 7]
    assert (result.usage.tokens, result.usage.prompts, result.usage.parts) == (17, 2, 2)
    assert result.timings.started_ms == 1500 and result.timings.compute_ms == 2.5
    assert (result.id, result.metadata, result.traceparent) == ("r-1", ME.metadata, ME.traceparent)


def test_an_error_result_answers_the_identity_not_the_entry():
    outcome = error_outcome(delivery(), ME, ErrorCode.DEAD_LETTERED, "gave up", "tiny")
    assert (outcome.request_id, outcome.reply_to) == ("r-1", ME.reply_to)
    assert outcome.result.error.code == ErrorCode.DEAD_LETTERED and outcome.result.metadata == ME.metadata
    assert outcome.publisher == f"{outcome.delivery.key} {outcome.delivery.entry_id} 1"


def test_a_whole_result_keeps_only_its_questions():
    result = ok_result(Identity("r-2"), [share(["a", "b"], 5, 1)], ["b"], 0, "tiny")
    assert list(result.answers) == ["b"] and result.metadata is None


class Published:
    """The Redis side settling every outcome at once, published by this delivery (what ``Publisher.settle``
    answers when Redis takes them all): this test is about the settle loop's order of work, not Redis."""

    model_name = "tiny"

    async def settle(self, outcomes):
        from worker.loop.publisher import Settlement

        return Settlement(settled=[(outcome, outcome.result, True) for outcome in outcomes])


def test_a_result_is_counted_before_its_entry_is_let_go():
    metrics = Metrics()
    counted_at_release: list[tuple[float, float]] = []

    async def scenario() -> None:
        redis_calls = RedisCalls(None, metrics, give_up=lambda: True, where="test")
        held = HeldEntries(Settings().max_inflight, metrics)
        settler = Settler(Published(), redis_calls, metrics, held, asyncio.get_running_loop())
        release = held.release

        def counted_then_release(entry: Delivery) -> None:
            counted_at_release.append((metrics.registry.get_sample_value("dq_results_total", {
                "status": "error", "code": "invalid_request"}) or 0.0, metrics.registry.get_sample_value(
                "dq_request_latency_seconds_count", {"status": "error", "lane": "normal"}) or 0.0))
            release(entry)

        held.release = counted_then_release
        running = asyncio.ensure_future(settler.run())
        for n in range(3):
            settler.put(error_outcome(delivery(n), Identity(f"r-{n}"), ErrorCode.INVALID_REQUEST, "bad", "tiny"))
        while len(counted_at_release) < 3:
            await asyncio.sleep(0.01)
        running.cancel()

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))
    assert counted_at_release == [(1.0, 1.0), (2.0, 2.0), (3.0, 3.0)]


def test_a_split_request_says_so_and_an_older_workers_share_still_loads():
    older = share(["a"], 3, 1).to_json().replace(', "split": false', "")
    assert '"split"' not in older and Share.from_json(older).split is False
    whole = ok_result(Identity("r-3"), [share(["a"], 3, 1)], ["a"], 0, "tiny")
    assert whole.usage.split is None and "split" not in whole.model_dump_json(exclude_none=True)
    split = Share(**{**share(["b"], 4, 2).__dict__, "split": True})
    assert ok_result(Identity("r-3"), [share(["a"], 3, 1), split], ["a", "b"], 0, "tiny").usage.split is True
