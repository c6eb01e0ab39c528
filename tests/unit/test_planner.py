import json
from pathlib import Path

import pytest
import torch

from producer.keys import Keys
from producer.schema import ErrorCode, RequestError
from worker.config import Settings
from worker.entries import PARTS, REQUESTS, Delivery
from worker.planner import Planner

BODY = {"id": "p-1", "state": "Refund please.", "questions": {
    "spam": {"type": "noul"}, "tone": {"type": "choice", "criteria": {"calm": None, "angry": None}}}}


def delivery(body: bytes, stream: str = REQUESTS, **fields: bytes) -> Delivery:
    return Delivery.parse(Keys(), stream, "key", "1-0",
                          {b"body": body, **{name.encode(): value for name, value in fields.items()}}, 1)


@pytest.fixture(scope="module", params=["threads", "processes"])
def planner(request, loaded):
    settings = Settings(planner_processes=1 if request.param == "processes" else 0, max_entry_bytes=5000)
    planner = Planner(loaded("repo"), settings)
    planner.warmup()
    yield planner
    planner.shutdown()


def test_plans_a_request_into_a_task(planner):
    task = planner.submit(delivery(json.dumps(BODY).encode())).result(timeout=60)
    assert task.request_id == "p-1" and task.parts == 1 and task.remaining == len(task.prompts) == 1
    [prompt] = task.prompts
    assert [q.name for q in prompt.questions] == ["spam", "tone"]
    assert prompt.input_ids.dtype == torch.long and prompt.length > 10


def test_parts_plan_only_their_questions(planner):
    part = delivery(b"", PARTS, request_id=b"p-1", part=b"1", parts=b"2", questions=b'["tone"]')
    task = planner.submit(part, json.dumps(BODY).encode()).result(timeout=60)
    assert (task.part, task.parts) == (1, 2) and task.request_id == "p-1"
    assert [q.name for c in task.prompts for q in c.questions] == ["tone"]


@pytest.mark.parametrize("body, code", [
    (b"{broken", ErrorCode.INVALID_JSON),
    (json.dumps({**BODY, "state": "x" * 6000}).encode(), ErrorCode.TOO_LARGE),
    (json.dumps({**BODY, "deadline_ms": 1}).encode(), ErrorCode.DEADLINE_EXCEEDED),
])
def test_bad_entries_fail_with_their_code(planner, body, code):
    with pytest.raises(RequestError) as error:
        planner.submit(delivery(body)).result(timeout=60)
    assert error.value.code == code and error.value.message


def test_planner_processes_leave_when_their_worker_is_killed(tmp_path):
    """kill -9 of a worker must not leave orphaned planner processes behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
        "import multiprocessing\n"
        "from worker.planner import _exit_with_parent\n"
        "if __name__ == '__main__':\n"
        "    child = multiprocessing.get_context('spawn').Process(target=_exit_with_parent, args=(os.getpid(),))\n"
        "    child.start()\n"
        "    print(child.pid, flush=True)\n"
        "    time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 60  # a spawned child may still be importing
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{child}/status").read().split("State:")[1].split()[0]
        except (FileNotFoundError, IndexError):
            return
        if state == "Z":  # exited; only its new parent can reap it
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    raise AssertionError("the planner process outlived its worker")
