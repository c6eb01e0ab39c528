"""Helpers of the fault tests: the fault-injecting worker's command line, request batches, waiting on logs."""

from __future__ import annotations

import time
from pathlib import Path

FAULTY = [str(Path(__file__).with_name("faulty_worker.py"))]  # entry point for start_worker(entry=...)

QUESTIONS = [
    {"type": "noul", "instructions": "Is this spam?"},
    {"type": "choice", "criteria": {"calm": "polite", "angry": None, "pushy": "pressure"}},
    {"type": "score", "criteria": ["low", "medium", "high"]},
]


def batch(n: int, tag: str, start: int = 0) -> list[dict]:
    """Small requests of one to three questions (a tiny model answers them in milliseconds)."""
    return [{"id": f"{tag}-{i}", "state": f"Message {i} of {tag}: please refund me.",
             "questions": {f"q{k}": QUESTIONS[k] for k in range(1 + i % 3)}} for i in range(start, start + n)]


def long_request(request_id: str, questions: int = 24) -> dict:
    """Over the fan-out threshold of workers started with ``FANOUT``: split into parts across workers."""
    return {"id": request_id, "state": f"A long request {request_id}.",
            "questions": {f"q{i}": {"type": "choice", "instructions": f"Question {i}?",
                                    "criteria": {"yes": "so", "no": "not"}} for i in range(questions)}}


FANOUT = dict(max_prompt_tokens=220, fanout_tokens=200)  # worker settings under which long_request fans out


def wait_for(predicate, timeout: float = 60.0, every: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"timed out waiting for {what}")


def wait_released(worker, timeout: float = 30.0) -> None:
    """Until the worker holds nothing: the answers to its acknowledgements have come back, and every result it
    published is counted. A drained queue (what ``settle`` waits for) is Redis' side of it: the worker counts a
    result when its XACK's answer arrives, a moment later."""
    wait_for(lambda: worker.metric("dq_inflight_entries") == 0, timeout, what="the worker to hold nothing")


def wait_log(worker, text: str, timeout: float = 60.0, count: int = 1) -> None:
    """Until the worker's log shows ``text`` (``count`` times)."""
    wait_for(lambda: worker.log.read_text(errors="replace").count(text) >= count, timeout,
             what=f"{text!r} in {worker.log.name}:\n" + worker.log.read_text(errors="replace")[-2000:])


def next_report(worker, timeout: float = 30.0) -> None:
    """Until an in-process worker's maintenance loop has made a whole report (stream stats, unread deletions,
    heartbeat; one every 5 s) that began after this call: what a fixed sleep of an interval and a half waited for,
    without waiting out the rest of it."""
    intake = worker.daemon.loop.intake
    since, begun = time.monotonic(), []

    async def report() -> None:
        started = time.monotonic()
        await real()
        if started > since:
            begun.append(started)

    real = intake._report
    intake._report = report
    try:
        wait_for(lambda: begun, timeout, what="the next report")
    finally:
        del intake._report  # the class's own again
