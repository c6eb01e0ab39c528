"""End to end: a real redis-server, real workers on the tiny checkpoint (CPU; in process but for kill -9), the real
producer."""

import pytest
import torch

from producer.client import Client
from producer.admin.audit import wait_and_check
from producer.wire.schema import Request
from support import png
from worker.model.encoder import Encoder
from worker.model.readout import answer, option_logits
from worker.model.reference import ReferenceEngine

pytestmark = [pytest.mark.redis, pytest.mark.slow]

QUESTIONS = {
    "spam": {"type": "noul", "instructions": "Is this spam?"},
    "tone": {"type": "choice", "criteria": {"calm": "polite", "angry": None, "pushy": "pressure"}},
    "urgency": {"type": "score", "criteria": ["low", "medium", "high"]},
}


def requests(n: int, tag: str = "r") -> list[dict]:
    out = []
    for i in range(n):
        questions = dict(list(QUESTIONS.items())[: 1 + i % 3])
        out.append({"id": f"{tag}-{i}", "state": f"Message number {i}: " + "please refund me " * (i % 7),
                    "questions": questions})
    return out


def expected_probabilities(model, request: dict) -> dict[str, list[float]]:
    """The in-process reference path on the same checkpoint."""
    prompts = Encoder(model).prompts(Request.model_validate(request))
    out = {}
    for prompt, scores in zip(prompts, ReferenceEngine(model).forward(prompts)):
        for q, logits in zip(prompt.questions, option_logits(model, prompt.questions, scores)):
            out[q.name] = answer(model.decision_config, q, logits).probabilities
    return out


def result_entries(client: Client, request_id: str) -> int:
    return client.redis.xlen(client.keys.result(request_id))


def test_many_requests_through_two_workers(redis_server, inprocess, loaded):
    # Parts of over-length requests must spread: each worker holds one entry at a time.
    settings = dict(max_prompt_tokens=220, fanout_tokens=200, read_count=1, max_inflight=1)
    workers = [inprocess(redis_server.url, **settings).start() for _ in range(2)]
    client = Client(redis_server.url)
    batch = requests(40)
    batch.append({"id": "image", "state": "Look at img-1.", "questions": QUESTIONS,
                  "assets": {"img-1": {"type": "image", "format": "png", "data_base64": png("red", (64, 64))}}})
    many = {f"q{i}": {"type": "choice", "instructions": f"Question {i}?", "criteria": {"yes": "so", "no": "not"}}
            for i in range(24)}
    batch += [{"id": f"long-{k}", "state": f"A state for long request {k}.", "questions": many} for k in range(2)]
    ids = client.submit_many(batch)
    results = client.wait_many(ids, timeout=180)

    model = loaded("repo", 220)
    for request in batch:
        result = results[request["id"]]
        assert result.ok, result.error
        assert list(result.answers) == list(request["questions"])  # request order, each question once
        if request["id"].startswith("long"):
            assert result.usage.parts > 1 and result.usage.prompts >= result.usage.parts
            # each part ran the reference path on its own questions: compare per part-sized prompt
            continue
        expected = expected_probabilities(model, request)
        for name, probabilities in expected.items():
            assert torch.allclose(torch.tensor(result.probabilities[name]), torch.tensor(probabilities),
                                  atol=1e-4), (request["id"], name)
    assert all(result_entries(client, r) == 1 for r in ids)  # exactly one result each
    # The long requests' parts went through the part stream, and both workers took some.
    parts_read = [w.metric("dq_entries_read_total", stream="chunks") for w in workers]
    assert sum(parts_read) == sum(results[f"long-{k}"].usage.parts for k in range(2))
    assert all(n >= 1 for n in parts_read), parts_read
    assert client.redis.xlen(client.keys.requests) == 0 and client.redis.xlen(client.keys.parts) == 0


def test_long_request_parts_equal_the_reference(redis_server, inprocess, loaded):
    # Planning in processes here (threads elsewhere): the same prompts either way.
    inprocess(redis_server.url, max_prompt_tokens=220, fanout_tokens=200, planner_processes=2).start()
    many = {f"q{i}": {"type": "noul", "instructions": f"Is statement {i} true?"} for i in range(20)}
    request = {"id": "long", "state": "Some state.", "questions": many}
    result = Client(redis_server.url).decide(request, timeout=120)
    assert result.ok and result.usage.parts > 1
    model = loaded("repo", 220)
    expected = expected_probabilities(model, request)  # the same question grouping, in process
    for name in many:
        assert result.probabilities[name] == pytest.approx(expected[name], abs=1e-4)


def test_dead_letters(redis_server, inprocess):
    client = Client(redis_server.url)
    keys = client.keys
    client.redis.xgroup_create(keys.requests, keys.group, id="0", mkstream=True)
    client.redis.xgroup_create(keys.parts, keys.group, id="0", mkstream=True)
    entry = client.submit({"id": "poison", "state": "x", "questions": {"q": {"type": "noul"}}})
    # A consumer that took the entry and crashed again and again: each claim bumps the delivery counter.
    client.redis.xreadgroup(keys.group, "crashy", {keys.requests: ">"})
    [(entry_id, _)] = client.redis.xrange(keys.requests)
    for _ in range(5):
        client.redis.xclaim(keys.requests, keys.group, "crashy", 0, [entry_id])
    worker = inprocess(redis_server.url, claim_idle_ms=300, max_deliveries=5).start()
    result = client.wait(entry, timeout=60)
    assert result.error.code.value == "dead_lettered" and "deliveries" in result.error.message
    [(_, fields)] = client.redis.xrange(keys.dead)
    assert fields[b"entry_id"] == entry_id and int(fields[b"deliveries"]) == 7 and b"body" in fields
    assert worker.metric("dq_dead_letters_total") == 1
    # The result is readable a moment before the worker's XACK and XDEL land: wait for the queue to drain (an
    # immediate XLEN raced them), then nothing is left of the entry.
    wait_and_check(client.redis, keys, [entry], timeout=30).assert_ok()


def test_kill_9_mid_work_the_other_worker_finishes(redis_server, start_worker, tiny_dir):
    victim = start_worker(tiny_dir, redis_server.url, claim_idle_ms=1500, max_inflight=64, read_count=64)
    client = Client(redis_server.url)
    ids = client.submit_many(requests(120, "kill"))
    client.wait(ids[0], timeout=60)
    victim.process.kill()
    victim.wait(10)
    keys = client.keys
    assert client.redis.xpending(keys.requests, keys.group)["pending"] > 0  # it died holding entries
    survivor = start_worker(tiny_dir, redis_server.url, claim_idle_ms=1500)
    results = client.wait_many(ids, timeout=180)
    assert all(results[r].ok for r in ids)
    assert all(result_entries(client, r) == 1 for r in ids)
    assert survivor.metric("dq_entries_read_total", how="reclaimed") > 0
