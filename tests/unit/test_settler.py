"""The settle loop (worker/loop/settler.py) counts a result before it lets its entry go: tests wait on
``dq_inflight_entries == 0`` and then compare the counters; counted after the release, a scrape could fall in
between."""

import asyncio

from producer.wire.keys import Keys
from producer.wire.schema import ErrorCode
from worker.config import Settings
from worker.entries import REQUESTS, Delivery, Identity
from worker.loop.held import HeldEntries
from worker.loop.publisher import Settlement
from worker.loop.redis_calls import RedisCalls
from worker.loop.settler import Settler
from worker.metrics import Metrics
from worker.outcomes import error_outcome

KEYS = Keys("dq")


def delivery(n: int = 0) -> Delivery:
    return Delivery.parse(REQUESTS, KEYS.requests, f"1700000000000-{n}", {b"body": b'{"id": "r-1"}'}, 1)


class Published:
    """The Redis side settling every outcome at once, published by this delivery (what ``Publisher.settle``
    answers when Redis takes them all): this test is about the settle loop's order of work, not Redis."""

    model_name = "tiny"

    async def settle(self, outcomes):
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
