import json

import pytest
import torch

from producer.schema import ErrorCode, RequestError
from worker.config import Settings
from worker.planner import Planner
from worker.tasks import CHUNKS, REQUESTS, Delivery

BODY = {"id": "p-1", "state": "Refund please.", "questions": {
    "spam": {"type": "noul"}, "tone": {"type": "choice", "criteria": {"calm": None, "angry": None}}}}


def delivery(body: bytes, stream: str = REQUESTS, **fields: bytes) -> Delivery:
    return Delivery(stream, "key", "1-0", {b"body": body, **{k.encode(): v for k, v in fields.items()}}, 1)


@pytest.fixture(scope="module", params=["threads", "processes"])
def planner(request, loaded):
    settings = Settings(planner_processes=1 if request.param == "processes" else 0, max_entry_bytes=5000)
    planner = Planner(loaded("repo"), settings)
    planner.warmup()
    yield planner
    planner.shutdown()


def test_plans_a_request_into_a_task(planner):
    task = planner.submit(delivery(json.dumps(BODY).encode())).result(timeout=60)
    assert task.request_id == "p-1" and task.parts == 1 and task.remaining == len(task.chunks) == 1
    [chunk] = task.chunks
    assert [q.name for q in chunk.questions] == ["spam", "tone"]
    assert chunk.input_ids.dtype == torch.long and chunk.length > 10


def test_parts_plan_only_their_questions(planner):
    part = delivery(b"", CHUNKS, request_id=b"p-1", part=b"1", parts=b"2", questions=b'["tone"]')
    task = planner.submit(part, json.dumps(BODY).encode()).result(timeout=60)
    assert (task.part, task.parts) == (1, 2) and task.request_id == "p-1"
    assert [q.name for c in task.chunks for q in c.questions] == ["tone"]


@pytest.mark.parametrize("body, code", [
    (b"{broken", ErrorCode.INVALID_JSON),
    (json.dumps({**BODY, "state": "x" * 6000}).encode(), ErrorCode.TOO_LARGE),
    (json.dumps({**BODY, "deadline_ms": 1}).encode(), ErrorCode.DEADLINE_EXCEEDED),
])
def test_bad_entries_fail_with_their_code(planner, body, code):
    with pytest.raises(RequestError) as error:
        planner.submit(delivery(body)).result(timeout=60)
    assert error.value.code == code and error.value.message
