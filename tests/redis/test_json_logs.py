"""``--log-format json``: every line a worker writes parses as JSON, from model load (transformers' progress bar
and its own handler once wrote plain lines there) through requests, bad input and the drain."""

import json
import signal

import pytest

from producer.client import Client
from producer.local.binaries import servers_under_test

pytestmark = pytest.mark.redis


def test_every_line_a_json_worker_writes_is_a_json_object(server_binary, redis_server, start_worker, tiny_dir):
    if server_binary.label != servers_under_test()[0].label:
        pytest.skip("one server is enough: what the worker writes does not depend on it")
    worker = start_worker(tiny_dir, redis_server.url, log_format="json", log_level="DEBUG")
    client = Client(redis_server.url)
    ids = client.submit_many([{"id": "j-1", "state": "Refund me!", "questions": {"q": {"type": "noul"}}}])
    assert client.wait_many(ids, timeout=60)["j-1"].ok
    client.redis.xadd("dq:v1:{s0}:requests", {"body": "{not json"})  # answered at once, with a warning
    worker.signal(signal.SIGTERM)
    assert worker.wait(60) == 0
    lines = worker.log.read_text().splitlines()
    assert len(lines) > 5
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            pytest.fail(f"not JSON: {line[:200]!r}")
        assert isinstance(record, dict) and {"ts", "level", "logger", "msg"} <= set(record), line
    assert any(json.loads(line)["msg"].startswith("ready") for line in lines)
