import json
import multiprocessing
import os
import subprocess
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from producer.wire.keys import HIGH, NORMAL
from producer.wire.schema import ErrorCode
from worker.config import Settings
from worker.entries import PARTS, REQUESTS, Delivery
from worker.plan import planner as planner_module
from worker.plan.planner import Planner, Refusal
from worker.plan.pool import LaneQueue, PlannerCrashed, _Waiting

BODY = {"id": "p-1", "state": "Refund please.", "questions": {
    "spam": {"type": "noul"}, "tone": {"type": "choice", "criteria": {"calm": None, "angry": None}}}}


def delivery(body: bytes | None, stream: str = REQUESTS, max_bytes: int | None = None, **fields: bytes) -> Delivery:
    own = {b"body": body} if body is not None else {}
    return Delivery.parse(stream, "key", "1-0", {**own, **{name.encode(): value for name, value in fields.items()}},
                          1, max_bytes)


@pytest.fixture(scope="module", params=["threads", "processes"])
def planner(request, loaded):
    settings = Settings(planner_processes=1 if request.param == "processes" else 0, max_entry_bytes=5000)
    planner = Planner(loaded("repo"), settings)
    planner.warmup()
    if request.param == "processes":
        assert planner.queue.claim_idle()  # counted busy for good: every entry goes to the processes, as under load
    yield planner
    planner.shutdown()


def test_plans_a_request_into_a_task(planner):
    task = planner.submit(delivery(json.dumps(BODY).encode())).result(timeout=60)
    assert task.request_id == "p-1" and task.delivery.parts == 1 and task.remaining == len(task.prompts) == 1
    [prompt] = task.prompts
    assert [q.name for q in prompt.questions] == ["spam", "tone"]
    assert prompt.input_ids.dtype == torch.long and prompt.length > 10


def test_parts_plan_only_their_questions(planner):
    part = delivery(None, PARTS, request_id=b"p-1", part=b"1", parts=b"2", questions=b'["tone"]',
                    enqueued_ms=b"5")
    task = planner.submit(part, json.dumps({**BODY, "reply_to": "dq:v1:reply:r", "metadata": {"k": 1}}).encode()
                          ).result(timeout=60)
    assert (task.delivery.part, task.delivery.parts) == (1, 2) and task.request_id == "p-1"
    # Its request's identity comes from the stored body: where its share's result replies, what it echoes.
    assert (task.identity.reply_to, task.identity.metadata) == ("dq:v1:reply:r", {"k": 1})
    assert [q.name for c in task.prompts for q in c.questions] == ["tone"]


@pytest.mark.parametrize("body, code, request_id", [
    (b"{broken", ErrorCode.INVALID_JSON, "1-0"),
    (json.dumps({**BODY, "state": "x" * 6000}).encode(), ErrorCode.TOO_LARGE, "p-1"),  # the leading id, unparsed
    (json.dumps({"pad": "x" * 6000, **BODY}).encode(), ErrorCode.TOO_LARGE, "1-0"),  # its id is not first
    (json.dumps({**BODY, "deadline_ms": 1}).encode(), ErrorCode.DEADLINE_EXCEEDED, "p-1"),
    (json.dumps({**BODY, "questions": {}}).encode(), ErrorCode.INVALID_REQUEST, "p-1"),
    (json.dumps({**BODY, "reply_to": "someone:else"}).encode(), ErrorCode.INVALID_REQUEST, "p-1"),
])
def test_bad_entries_are_refused_with_their_code_and_identity(planner, body, code, request_id):
    refusal = planner.submit(delivery(body, max_bytes=5000)).result(timeout=60)
    assert isinstance(refusal, Refusal) and refusal.code == code and refusal.message
    assert refusal.identity.request_id == request_id


def test_a_bad_field_is_answered_with_the_identity_the_body_gives(planner):
    refusal = planner.submit(delivery(json.dumps({**BODY, "reply_to": "dq:v1:reply:r"}).encode(), other=b"x")
                             ).result(timeout=60)
    assert isinstance(refusal, Refusal) and refusal.message.startswith("field 'other' is not a field")
    assert (refusal.identity.request_id, refusal.identity.reply_to) == ("p-1", "dq:v1:reply:r")


def test_a_part_whose_request_body_is_gone_is_refused_as_internal(planner):
    part = delivery(None, PARTS, request_id=b"p-9", part=b"0", parts=b"2", questions=b'["tone"]',
                    enqueued_ms=b"5")
    refusal = planner.submit(part, None).result(timeout=60)
    assert isinstance(refusal, Refusal) and refusal.code == ErrorCode.INTERNAL
    assert refusal.identity.request_id == "p-9"


# ---- with processes, idle planners plan a lone entry in a thread of the worker (no process hop)


@pytest.fixture(scope="module")
def two(loaded):
    planner = Planner(loaded("repo"), Settings(planner_processes=2, max_entry_bytes=5000))
    planner.warmup()
    yield planner
    planner.shutdown()


@pytest.fixture
def planned_here(monkeypatch):
    """The names of the threads of this process that planned (a planner process plans out of sight); a planning
    waits while ``hold`` is set."""
    names, hold, original = [], threading.Event(), planner_module.plan_entry

    def plan_entry(*args):
        names.append(threading.current_thread().name)
        while hold.is_set():
            time.sleep(0.01)
        return original(*args)

    monkeypatch.setattr(planner_module, "plan_entry", plan_entry)
    return names, hold


def test_idle_planner_processes_leave_a_lone_entry_to_a_thread_of_the_worker(two, planned_here):
    names, _ = planned_here
    task = two.submit(delivery(json.dumps(BODY).encode()), alone=True).result(timeout=60)
    assert task.request_id == "p-1" and names == ["planner-here_0"]
    assert two.queue.running == 0


def test_an_entry_beside_others_in_the_worker_goes_to_the_processes_even_when_they_are_idle(two, planned_here):
    """Beside other held work a pack may run: planning stays off the worker's GIL."""
    names, _ = planned_here
    assert two.submit(delivery(json.dumps(BODY).encode()), alone=False).result(timeout=60) and names == []


@pytest.mark.parametrize("body", [
    {**BODY, "assets": {"img": {"type": "image", "format": "png", "data_base64": "AAAA"}}},
    {**BODY, "state": "Erstattung \u2013 bitte"},  # json.dumps escapes it: \\u could spell "assets"
])
def test_entries_that_may_hold_images_are_planned_in_the_processes_even_when_idle(two, planned_here, body):
    """An image decoder that crashes must cost a planner process, never the worker."""
    names, _ = planned_here
    assert two.submit(delivery(json.dumps(body).encode()), alone=True).result(timeout=60) and names == []


def test_while_a_job_runs_in_the_processes_the_next_goes_there_too(two, planned_here, tmp_path):
    names, _ = planned_here
    gate = tmp_path / "open"
    wait = f"for i in $(seq 1200); do [ -e {gate} ] && exit 0; sleep 0.05; done; exit 1"
    running = two.queue.submit(NORMAL, subprocess.call, ["sh", "-c", wait])  # in a planner process until opened
    try:
        task = two.submit(delivery(json.dumps(BODY).encode()), alone=True).result(timeout=60)
        assert task.request_id == "p-1" and names == [] and not running.done()
    finally:
        gate.touch()
    assert running.result(timeout=60) == 0


def test_while_a_job_runs_in_the_thread_the_next_goes_to_the_processes(two, planned_here):
    names, hold = planned_here
    hold.set()
    first = two.submit(delivery(json.dumps(BODY).encode()), alone=True)
    try:
        deadline = time.monotonic() + 60
        while not names and time.monotonic() < deadline:  # the first is planning, in the thread
            time.sleep(0.01)
        second = two.submit(delivery(json.dumps({**BODY, "id": "p-2"}).encode()), alone=True).result(timeout=60)
        assert second.request_id == "p-2" and not first.done() and names == ["planner-here_0"]
    finally:
        hold.clear()
    assert first.result(timeout=60).request_id == "p-1"


@pytest.mark.parametrize("body", [json.dumps(BODY).encode(), json.dumps({**BODY, "questions": {}}).encode(),
                                  b"{broken"])
def test_the_thread_and_the_processes_plan_alike(two, planned_here, body):
    names, _ = planned_here
    here = two.submit(delivery(body, max_bytes=5000), alone=True).result(timeout=60)
    assert two.queue.claim_idle()  # busy: the next goes to the processes
    try:
        there = two.submit(delivery(body, max_bytes=5000), alone=True).result(timeout=60)
    finally:
        two.queue.release()
    assert names == ["planner-here_0"]  # one each way
    if isinstance(here, Refusal):
        assert here == there
        return
    assert (here.identity, here.request, here.fan_out) == (there.identity, there.request, there.fan_out)
    assert len(here.prompts) == len(there.prompts) > 0
    for mine, theirs in zip(here.prompts, there.prompts):
        assert (mine.questions, mine.split) == (theirs.questions, theirs.split)
        for name in ("input_ids", "rows", "pixel_values", "image_grid_thw", "mm_token_type_ids"):
            a, b = getattr(mine, name), getattr(theirs, name)
            assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), name


def test_planner_processes_leave_when_their_worker_is_killed(tmp_path):
    """kill -9 of a worker must not leave orphaned planner processes behind."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
        "import multiprocessing\n"
        "from worker.plan.planner import _exit_with_parent\n"
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


# ---- LaneQueue: planning jobs wait in lane order


def gated(normal_share: float):
    """A LaneQueue over one thread, and a job that records its start and waits for the gate to open."""
    gate, started, pool = threading.Event(), [], ThreadPoolExecutor(1)

    def job(name: str) -> str:
        started.append(name)
        gate.wait(10)
        return name

    return LaneQueue(pool, depth=1, normal_share=normal_share), job, gate, started, pool


def test_planning_jobs_start_in_lane_order():
    lanes, job, gate, started, pool = gated(0.1)
    futures = [lanes.submit(NORMAL, job, f"n{i}") for i in range(5)] + [lanes.submit(HIGH, job, "h")]
    gate.set()
    assert [f.result(timeout=10) for f in futures] == ["n0", "n1", "n2", "n3", "n4", "h"]
    assert started == ["n0", "h", "n1", "n2", "n3", "n4"]  # n0 was running; h overtook the waiting ones
    pool.shutdown()


def test_waiting_normal_planning_jobs_get_their_share_of_the_starts():
    lanes, job, gate, started, pool = gated(0.25)
    futures = [lanes.submit(HIGH, job, "first")]
    futures += [lanes.submit(NORMAL, job, f"n{i}") for i in range(3)] + [lanes.submit(HIGH, job, f"h{i}")
                                                                        for i in range(12)]
    gate.set()
    for future in futures:
        future.result(timeout=10)
    order = started[1:]
    assert [i for i, name in enumerate(order) if name.startswith("n")] == [3, 7, 11]  # every 4th start
    pool.shutdown()


def test_a_dead_planner_process_costs_only_the_job_that_killed_it():
    """A process pool breaks for good when one of its processes dies, failing every job in it: the queue replaces
    the pool and runs the jobs it held again, one at a time; only the one that kills a process alone fails."""
    spawn = multiprocessing.get_context("spawn")
    pools = []

    def renew(broken):
        pools.append(ProcessPoolExecutor(2, spawn))
        return pools[-1]

    lanes = LaneQueue(renew(None), depth=4, normal_share=0.1, renew=renew)
    innocent = [lanes.submit(NORMAL, time.sleep, 0.5) for _ in range(3)]
    killer = lanes.submit(HIGH, os._exit, 1)  # as the OOM killer or a crash in a decoder would end the process
    later = [lanes.submit(NORMAL, pow, 2, n) for n in range(3)]
    with pytest.raises(PlannerCrashed):
        killer.result(timeout=60)
    assert [f.result(timeout=60) for f in innocent] == [None] * 3
    assert [f.result(timeout=60) for f in later] == [1, 2, 4]
    assert len(pools) == 3  # the first broke with every job in it, the second with the killer alone
    for pool in pools:
        pool.shutdown()


def test_jobs_submitted_after_shutdown_fail_without_recursing():
    """A submit refused by a shut-down pool failed the job through a callback run at once, which started the next
    job, and so on: thousands waiting exhausted the stack and left futures unset."""
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    lanes = LaneQueue(pool, depth=4, normal_share=0.1)
    jobs = [_Waiting(Future(), time.sleep, (0,), NORMAL) for _ in range(3000)]
    lanes.waiting[NORMAL].extend(jobs)  # all waiting before the first start
    lanes._pump()
    assert all(isinstance(job.out.exception(timeout=1), RuntimeError) for job in jobs)
    assert lanes.running == 0
