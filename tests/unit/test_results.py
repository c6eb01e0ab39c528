"""The results stage's bookkeeping (worker/results.py): an outcome's result is counted before its entry is let go, so
that a worker holding nothing has counted every result it published (tests wait on ``dq_inflight_entries == 0``
and then compare the counters; counted after the release, a scrape could fall in between)."""

import asyncio
import json

from producer.keys import Keys
from producer.schema import ErrorCode
from worker.entries import REQUESTS, Delivery
from worker.link import Link
from worker.metrics import Metrics
from worker.results import Results, error_outcome

KEYS = Keys("dq")


class Published:
    """The Redis side of publication, settled at once: every outcome published by this delivery and acknowledged
    (what ``publisher.Publisher.settle`` answers when Redis takes them all)."""

    model = "tiny"
    reply_refused = None

    async def settle(self, outcomes):
        return [(outcome, outcome.result, True) for outcome in outcomes]


def test_a_result_is_counted_before_its_entry_is_let_go():
    metrics = Metrics()
    counted_at_release: list[tuple[float, float]] = []

    def release(delivery: Delivery) -> None:
        counted_at_release.append((metrics.registry.get_sample_value("dq_results_total", {
            "status": "error", "code": "invalid_request"}) or 0.0, metrics.registry.get_sample_value(
            "dq_request_latency_seconds_count", {"status": "error", "priority": "normal"}) or 0.0))

    async def scenario() -> None:
        results = Results(Published(), Link(None, metrics, give_up=lambda: True, where="test"),
                          asyncio.get_running_loop(), metrics, release=release, fail=lambda delivery, reason: None)
        running = asyncio.ensure_future(results.run())
        for n in range(3):
            delivery = Delivery.parse(KEYS, REQUESTS, KEYS.requests, f"1700000000000-{n}",
                                      {b"body": json.dumps({"id": f"r-{n}"}).encode()}, 1)
            results.settle(error_outcome(delivery, ErrorCode.INVALID_REQUEST, "bad", "tiny"))
        while len(counted_at_release) < 3:
            await asyncio.sleep(0.01)
        running.cancel()

    asyncio.run(asyncio.wait_for(scenario(), timeout=10))
    assert counted_at_release == [(1.0, 1.0), (2.0, 2.0), (3.0, 3.0)]
