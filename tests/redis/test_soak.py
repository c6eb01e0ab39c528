"""Soak: several worker processes and producer threads for a bounded time (10 s of submitting, about 20 s in all
on CPU), one worker killed (-9) and replaced midway; throughput is printed, the invariant is asserted. The same code
as ops/soak.py, which runs it against a real deployment. Deselect with ``-m 'not soak'``."""

from __future__ import annotations

import json
import threading

import pytest

from ops.soak import run

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.soak]

WORKER = dict(claim_idle_ms=2000, read_count=16, max_inflight=64, max_deliveries=5)


def test_soak_several_workers_and_producers_nothing_lost_nothing_duplicated(redis_server, start_worker, tiny_dir):
    workers = [start_worker(tiny_dir, redis_server.url, ready=False, **WORKER) for _ in range(3)]
    for worker in workers:
        worker.wait_ready()
    replaced = []

    def kill_one():  # mid-soak: a worker dies holding entries, a fresh one joins
        workers[0].process.kill()
        replaced.append(start_worker(tiny_dir, redis_server.url, ready=False, **WORKER))

    killer = threading.Timer(4.0, kill_one)
    killer.start()
    soak = run(redis_server.url, requests=50_000, producers=4, duration=10.0, bad_fraction=0.02,
               max_unfinished=400, timeout=120.0)
    killer.join()
    stats = soak.stats()
    print("\nsoak:", json.dumps(stats))
    assert not stats["problems"], stats["problems"]
    assert stats["answered"] == stats["submitted"] > 500 and stats["bad"] > 0
    assert replaced and replaced[0].process.poll() is None
    replaced[0].wait_ready()  # on a loaded machine it may still be loading: its metrics port opens when ready
    assert sum(w.metric("dq_entries_read_total", how="reclaimed") for w in workers[1:] + replaced) > 0
