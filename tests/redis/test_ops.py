"""Operations: the Prometheus metrics of a worker move as the work goes (scraped during an end to end), and health
follows the loops, not Redis: a hung or stopped Redis makes a worker unready, never dead."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from producer.client import Client
from test_e2e import QUESTIONS, requests

pytestmark = [pytest.mark.redis, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
# Every label a dq_ metric may carry: dimensions with a handful of values, never an id.
LABELS = {"shard", "stream", "lane", "how", "status", "code", "op", "size", "mode", "kind", "loop", "version",
          "model", "engine", "device", "le", "outcome",  # outcome: dq_cancels_total
          "state",  # state: dq_request_state_seconds
          "deterministic"}  # dq_build_info: true or false, as the worker decided


def eventually(condition, timeout: float = 15.0, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(every)


def test_metrics_move_as_the_work_goes(redis_server, start_worker, tiny_dir):
    client = Client(redis_server.url)
    # A backlog before the worker starts, so that the stream gauges see it; one entry at a time keeps it there.
    batch = requests(120, "m")
    many = {f"q{i}": {"type": "noul", "instructions": f"Is statement {i} true?"} for i in range(20)}
    batch.append({"id": "long", "state": "Some state.", "questions": many})
    started = time.time()
    ids = client.submit_many(batch)
    client.redis.xadd(client.keys.requests, {"body": "{oops"})
    worker = start_worker(tiny_dir, redis_server.url, max_prompt_tokens=220, fanout_tokens=200, read_count=1,
                          max_inflight=1, log_format="json")

    first = worker.metrics()
    [info] = [labels for (name, labels), value in first.items() if name == "dq_build_info" and value == 1]
    assert dict(info)["engine"] == "reference" and dict(info)["device"] == "cpu" and dict(info)["model"]
    assert dict(info)["deterministic"] == "false"  # off by default on the CPU (worker/fast/deterministic.py)
    assert worker.metric("dq_ready") == 1
    # The maintenance loop's stream stats see the backlog (refreshed every 5 s).
    assert eventually(lambda: worker.metric("dq_stream_length", shard="0", stream="requests") > 10
                      and worker.metric("dq_stream_lag", shard="0", stream="requests") > 10, timeout=10), worker.metrics()

    results = client.wait_many([*ids], timeout=120)
    wall = time.time() - started
    ok = [results[r] for r in ids]
    assert all(r.ok for r in ok)
    parts = results["long"].usage.parts
    assert parts > 1
    m = worker.metric
    assert eventually(lambda: m("dq_results_total") == len(ids) + 1)  # counted once acknowledged
    assert eventually(lambda: m("dq_stream_length", stream="requests") == 0
                      and m("dq_stream_lag", stream="requests") == 0 and m("dq_stream_pending", stream="requests") == 0
                      and m("dq_stream_length", stream="chunks") == 0, timeout=10)

    # Entries taken: every request once (and the bad one), every part once; nothing redelivered.
    assert m("dq_entries_read_total", stream="requests") == len(ids) + 1
    assert m("dq_entries_read_total", stream="chunks") == parts
    assert m("dq_redeliveries_total") == 0 and m("dq_dead_letters_total") == 0 and m("dq_redis_errors_total") == 0
    assert m("dq_fanouts_total") == 1
    # Results by status and code.
    assert m("dq_results_total", status="ok") == len(ids)
    assert m("dq_results_total", status="error", code="invalid_json") == 1
    # End-to-end latency, from the entry id's enqueue time to publication: one observation per result, and it
    # agrees with the timings the results carry (published a moment after finished_ms).
    assert eventually(lambda: m("dq_request_latency_seconds_count") == len(ids) + 1)  # observed after the count
    assert m("dq_request_latency_seconds_count", status="ok") == len(ids)  # errors apart: they skew no percentile
    assert m("dq_request_latency_seconds_count", status="error") == 1
    producer_view = sum(r.timings.finished_ms - r.timings.enqueued_ms for r in ok) / 1000
    assert producer_view * 0.95 <= m("dq_request_latency_seconds_sum") <= producer_view + 0.5 * len(ids) + wall
    assert m("dq_request_latency_seconds_bucket", le="+Inf") == len(ids) + 1
    assert m("dq_request_latency_seconds_count", lane="normal") == len(ids) + 1  # all in the normal lane
    assert m("dq_request_latency_seconds_count", lane="high") == 0
    # The backlog waited in the queue: the queue wait grew beyond the first entries' (a spread, not all zeros).
    assert m("dq_queue_wait_seconds_count") == len(ids) + 1 + parts
    assert m("dq_queue_wait_seconds_sum") > 0.5
    assert m("dq_planning_seconds_count") == len(ids) + 1 + parts
    # Where the time went: every computed entry (the requests but the fanned-out one, and its parts) once in each
    # state after it was taken; the refused one in none.
    for state in ("planning", "queued", "computing", "settling"):
        assert m("dq_request_state_seconds_count", state=state, lane="normal") == len(ids) - 1 + parts, state
        assert m("dq_request_state_seconds_sum", state=state) > 0, state
    assert m("dq_request_state_seconds_count", lane="high") == 0
    # The collector's passes are timed while the worker serves (young ones certainly ran over 120 requests).
    assert m("dq_gc_pause_seconds_count") > 0
    # Packs: eager on CPU (no CUDA graphs), one forward observation per pack, fill in (0, 1].
    packs = m("dq_packs_total")
    assert packs > 0 and m("dq_packs_total", mode="eager") == packs and m("dq_packs_total", mode="graph") == 0
    assert m("dq_forward_seconds_count", size="eager") == packs
    assert m("dq_pack_fill_ratio_count") == packs and 0 < m("dq_pack_fill_ratio_sum") <= packs
    assert m("dq_tokens_total") == sum(r.usage.tokens for r in ok)
    assert m("dq_inflight_entries") == 0
    now = time.time()
    for loop in ("reader", "gpu", "maintenance"):
        assert now - 15 < m("dq_loop_heartbeat_timestamp_seconds", loop=loop) <= now + 1, loop

    # Logs: JSON lines, one per state change (start, ready), never one per request.
    lines = [json.loads(line) for line in worker.log.read_text().splitlines() if line.startswith("{")]
    assert lines and all({"ts", "level", "logger", "msg"} <= set(line) for line in lines)
    assert any(line["msg"].startswith("ready:") for line in lines)
    assert len([line for line in lines if line["level"] == "info"]) < 10, lines

    # One prefix, no ids as labels (a handful of series whatever the traffic), beside the process collectors.
    samples = worker.metrics()
    assert all(name.startswith(("dq_", "process_", "python_")) for name, _ in samples)
    assert {key for name, labels in samples for key, _ in labels if name.startswith("dq_")} <= LABELS
    assert len(samples) < 425  # 407 with dq_pack_launch_seconds: a fixed count, whatever the traffic
    assert m("process_resident_memory_bytes") > 10e6 and m("process_cpu_seconds_total") > 0
    assert m("python_info") == 1 and m("dq_ready", shard="0") == 1


def check(worker, live: bool = False) -> int:
    args = [sys.executable, "-m", "worker", "check", "--url", f"http://127.0.0.1:{worker.port}"]
    return subprocess.run(args + (["--live"] if live else []), capture_output=True, timeout=60, cwd=ROOT).returncode


def test_redis_outage_makes_the_worker_unready_never_dead(redis_server, inprocess):
    worker = inprocess(redis_server.url, http=True).start()
    assert worker.get("/healthz")[0] == 200 and worker.get("/readyz")[0] == 200
    assert check(worker) == 0 and check(worker, live=True) == 0
    client = Client(redis_server.url)

    def unready_while_alive() -> bool:
        assert worker.get("/healthz")[0] == 200  # liveness never follows Redis
        return worker.get("/readyz")[0] == 503

    # Hung Redis (a partition looks the same): the blocking read waits out its socket timeout and retries.
    redis_server.pause()
    assert eventually(unready_while_alive, timeout=12)
    assert json.loads(worker.get("/readyz")[1])["redis"] is False
    assert check(worker) == 1 and check(worker, live=True) == 0
    redis_server.resume()
    assert eventually(lambda: worker.get("/readyz")[0] == 200, timeout=10)

    # Redis gone: unready at once, alive through the client's whole retry budget, errors counted.
    redis_server.stop()
    assert eventually(unready_while_alive, timeout=12)
    assert eventually(lambda: unready_while_alive() and worker.metric("dq_redis_errors_total") > 0, timeout=30)
    assert worker.metric("dq_ready") == 0
    redis_server.start()
    assert eventually(lambda: worker.get("/readyz")[0] == 200, timeout=20)
    assert client.decide({"id": "after", "state": "back", "questions": QUESTIONS}, timeout=60).ok


def test_redis_bench_replays_the_request_traffic():
    """ops/redis_bench.py (docs/SCALING.md's numbers), small: every request settled, the per-request commands."""
    done = subprocess.run([sys.executable, "ops/redis_bench.py", "--requests", "400", "--producers", "2",
                           "--consumers", "2", "--batch", "100"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["settled"] == report["requests"] == 400
    calls = report["commands_per_request"]
    # Per request: its XADD and its result's XADD; the publish function (XRANGE, EXPIRE, DEL inside); the
    # producer's XRANGE of the result. XACK and XDEL once per stream of a settled batch, every entry id in each.
    assert calls["xadd"] == calls["xrange"] == 2 and calls["del"] == 1
    assert 0 < calls["xack"] == calls["xdel"] < 0.5
    assert 1 <= calls["fcall"] <= 1.02 and calls["xreadgroup"] < 1 and "evalsha" not in calls
    assert report["redis_cpu_us_per_request"] > 0 and report["memory_bytes_per_result"] > 500
