"""Cancel and status on a real server with real workers (docs/PROTOCOL.md, "Cancelling" and "Status"): a request
cancelled before it is packed is never computed (the engine's count of launched prompts and their texts say so), one
in a pack is answered normally, a cancel racing publication leaves one result that says which won, a fanned-out
request's unpacked parts are dropped and it is answered `cancelled` once, unknown and answered ids are harmless, and
another tenant's credential cannot cancel. The GPU stage is held at a gate where a test needs a pack in flight."""

import asyncio
import json
import subprocess
import sys
import threading
import time

import pytest
import redis

from producer.client import AsyncClient, Client, InvalidRequest
from producer.plumbing import library_loader
from producer.wire.keys import Keys, Record
from producer.wire.schema import ErrorCode
from test_e2e import QUESTIONS

pytestmark = pytest.mark.redis
KEYS = Keys()
MANY = {f"q{i}": {"type": "noul", "instructions": f"Is statement {i} true?"} for i in range(20)}  # fans out


def request(request_id: str, questions: dict | None = None) -> dict:
    return {"id": request_id, "state": f"The state of {request_id}.", "questions": questions or QUESTIONS}


def until(condition, timeout: float = 60.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def computed(worker, request_id: str) -> bool:
    """Whether any prompt of the request was launched (its state's text is in a launched prompt)."""
    return any(f"The state of {request_id}." in text for text in worker.faults.texts)


def held_states(worker) -> dict[str, str]:
    return {held.request_id: held.state for held in list(worker.daemon.loop.held.entries.values())}


def gated(inprocess, url: str, **settings):
    """An in-process worker whose packs wait at a gate (closed), keeping every launched prompt's text."""
    worker = inprocess(url, **settings)
    worker.faults.texts, worker.faults.gate = [], threading.Event()
    stop = worker.stop

    def opened_then_stopped(*args, **kwargs):  # a test that failed with the gate closed still stops its worker
        worker.faults.gate.set()
        return stop(*args, **kwargs)

    worker.stop = opened_then_stopped
    return worker


def test_a_request_cancelled_before_it_is_packed_is_never_computed(redis_server, inprocess):
    client = Client(redis_server.url)
    # Queued, no worker running: cancelled at once, never computed whenever a worker comes.
    client.submit_many([request("waiting-0"), request("waiting-1"), request("kept")])
    assert client.status("waiting-0")["waiting-0"].state == "queued"
    assert {a.state for a in client.cancel(["waiting-0", "waiting-1"]).values()} == {"cancelled"}
    assert client.status("waiting-1")["waiting-1"].state == "cancelled"
    worker = gated(inprocess, redis_server.url, max_wait_ms=1)
    worker.start()
    worker.faults.gate.set()
    results = client.wait_many(["waiting-0", "waiting-1", "kept"], timeout=60)
    assert results["kept"].ok and worker.faults.prompts == 1
    assert [results[r].error.code for r in ("waiting-0", "waiting-1")] == [ErrorCode.CANCELLED] * 2
    assert not computed(worker, "waiting-0") and not computed(worker, "waiting-1")

    # Planned and waiting in the packer behind a pack held at the gate: withdrawn by the notice, never computed.
    worker.faults.gate.clear()
    client.submit(request("blocker"))
    until(lambda: computed(worker, "blocker"), what="the blocker's pack")
    client.submit_many([request("late-0"), request("late-1")])
    until(lambda: held_states(worker).get("late-0") == "queued" == held_states(worker).get("late-1"),
          what="both queued in the packer")
    before = worker.metric("dq_cancels_total", outcome="honoured")
    # A worker holds it: its worker decides (and may have answered `cancelled` by the time the call returns).
    assert client.cancel("late-0")["late-0"].state in ("cancelling", "cancelled")
    until(lambda: worker.metric("dq_cancels_total", outcome="honoured") == before + 1, what="the cancel honoured")
    worker.faults.gate.set()
    results = client.wait_many(["blocker", "late-0", "late-1"], timeout=60)
    assert results["blocker"].ok and results["late-1"].ok and results["late-0"].error.code == ErrorCode.CANCELLED
    assert not computed(worker, "late-0") and worker.faults.prompts == 3
    assert client.redis.xlen(KEYS.result("late-0")) == 1
    assert client.status("late-0")["late-0"].state == "cancelled"
    again = client.cancel("late-0")["late-0"]  # answered `cancelled`: a second cancel changes nothing
    assert again.state == "cancelled" and again.code == "cancelled"


def test_a_request_sent_again_after_its_cancel_says_what_becomes_of_it(redis_server, inprocess):
    """Cancelled while queued, then sent again under its id before any worker read it: its status says
    ``cancelled`` (the cancel mark kept), and that is what both entries are answered, once, never computed. Before,
    the second submit cleared the mark: status said ``queued`` with no cancel, and it ended ``cancelled`` all the
    same (the first entry's notice answered the id, the second entry found that answer). The answer says what to
    do: an id is answered once, so a request meant to run is sent under a new id."""
    client = Client(redis_server.url)
    client.submit(request("resent"))
    assert client.cancel("resent")["resent"].state == "cancelled"
    client.submit(request("resent"))
    status = client.status("resent")["resent"]
    assert status.state == "cancelled" and status.cancel_requested_ms is not None, status
    worker = gated(inprocess, redis_server.url, max_wait_ms=1)
    worker.start()
    worker.faults.gate.set()
    result = client.wait("resent", timeout=60)
    assert result.error.code == ErrorCode.CANCELLED and "under a new id" in result.error.message, result
    until(lambda: not client.redis.xlen(KEYS.requests), what="both entries read")
    assert client.redis.xlen(KEYS.result("resent")) == 1 and not computed(worker, "resent")
    assert client.status("resent")["resent"].state == "cancelled"


def test_a_request_in_a_pack_is_answered_normally(redis_server, inprocess):
    client = Client(redis_server.url)
    worker = gated(inprocess, redis_server.url, max_wait_ms=1).start()
    client.submit(request("packed"))
    until(lambda: computed(worker, "packed"), what="its pack")  # launched, held at the gate
    assert client.cancel("packed")["packed"].state == "cancelling"
    until(lambda: worker.metric("dq_cancels_total", outcome="too_late") == 1, what="the cancel found too late")
    worker.faults.gate.set()
    assert client.wait("packed", timeout=60).ok
    assert client.redis.xlen(KEYS.result("packed")) == 1
    assert client.cancel("packed")["packed"].state == "too_late"
    until(lambda: client.status("packed")["packed"].status == "ok", what="its record saying how it was answered")
    status = client.status("packed")["packed"]
    assert status.state == "answered" and status.cancel_requested_ms is not None and status.answered_ms
    assert worker.metric("dq_cancels_total", outcome="honoured") == 0


def test_cancels_racing_publication_leave_one_result_that_says_which_won(redis_server, inprocess):
    client = Client(redis_server.url)
    # Few entries held at a time, so the queue drains while the cancels come: some not yet delivered.
    worker = inprocess(redis_server.url, max_wait_ms=2, pack_tokens=512, max_inflight=4, read_count=2)
    worker.faults.texts = []
    worker.start()
    ids = client.submit_many([request(f"race-{i}") for i in range(60)])
    answers = {}
    # One at a time, the last sent first, while the worker drains from the first: the cancels and the worker meet,
    # so some find their entry queued, some held, some answered.
    for request_id in reversed(ids):
        answers.update(client.cancel(request_id))
        time.sleep(0.01)
    results = client.wait_many(ids, timeout=120)
    for request_id in ids:
        assert client.redis.xlen(KEYS.result(request_id)) == 1
        result, answer = results[request_id], answers[request_id].state
        cancelled = not result.ok and result.error.code == ErrorCode.CANCELLED
        assert cancelled != computed(worker, request_id)  # `cancelled` exactly when never computed
        assert {"cancelled": cancelled, "too_late": result.ok}.get(answer, True), (request_id, answer, result)
    assert {answer.state for answer in answers.values()} >= {"cancelled"}
    assert worker.faults.prompts == sum(result.ok for result in results.values())


def test_a_fanned_out_request_drops_its_unpacked_parts_and_is_answered_cancelled_once(redis_server, inprocess):
    client = Client(redis_server.url)
    # One part per pack, two parts held at a time: parts wait in the packer and in the part stream.
    worker = gated(inprocess, redis_server.url, max_prompt_tokens=220, fanout_tokens=200, pack_tokens=256,
                   max_inflight=2, read_count=1, max_wait_ms=1).start()
    client.submit(request("long", MANY))
    until(lambda: client.status("long")["long"].state == "in_progress" and worker.faults.prompts >= 1,
          what="its first part packed")
    status = client.status("long")["long"]
    assert status.parts and status.parts > 2 and status.parts_done == 0
    assert client.cancel("long")["long"].state in ("cancelling", "cancelled")  # a dropped part may answer it first
    until(lambda: worker.metric("dq_cancels_total", outcome="honoured") >= 1, what="a queued part dropped")
    worker.faults.gate.set()
    result = client.wait("long", timeout=60)
    assert result.error.code == ErrorCode.CANCELLED
    until(lambda: not worker.daemon.loop.held and client.redis.xlen(KEYS.parts) == 0, what="every part settled")
    assert client.redis.xlen(KEYS.result("long")) == 1 and client.wait("long", timeout=1) == result
    assert worker.faults.prompts < status.parts  # the parts not packed when the cancel came were never computed
    until(lambda: client.status("long")["long"].state == "cancelled", what="its record saying so")


def test_cancelling_an_unknown_or_answered_id_is_harmless_and_says_so(redis_server, inprocess):
    client = Client(redis_server.url)
    worker = inprocess(redis_server.url).start()
    assert client.wait(client.submit(request("done")), timeout=60).ok
    until(lambda: client.status("done")["done"].status == "ok", what="its record saying how it was answered")
    answers = client.cancel(["done", "never-sent", "done"])
    assert list(answers) == ["done", "never-sent"]
    assert answers["done"].state == "too_late" and answers["done"].status == "ok"
    assert answers["never-sent"].state == "unknown"
    assert client.status("never-sent")["never-sent"].state == "unknown"
    assert not client.redis.exists(KEYS.result("never-sent"), KEYS.record("never-sent"))
    # The id sent after the cancel is answered as any other; the answered one is unchanged.
    assert client.wait(client.submit(request("never-sent")), timeout=60).ok
    assert client.redis.xlen(KEYS.result("done")) == 1 and client.fetch("done").ok
    assert client.redis.hgetall(KEYS.cancel_counts) == {b"answered": b"1", b"unknown": b"1"}
    with pytest.raises(InvalidRequest):
        client.cancel(["bad id"])
    assert worker.metric("dq_cancels_total", outcome="honoured") == 0
    # The same through dq-producer (exit 1: one was too late) and the asyncio client.
    shown = subprocess.run([sys.executable, "-m", "producer", "cancel", "done", "never-sent-2", "--redis-url",
                            redis_server.url], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 1, shown.stderr
    assert [json.loads(line)["state"] for line in shown.stdout.splitlines()] == ["too_late", "unknown"]
    assert subprocess.run([sys.executable, "-m", "producer", "cancel", "bad id", "--redis-url", redis_server.url],
                          capture_output=True, timeout=60).returncode == 2

    async def asynchronously():
        async with AsyncClient(redis_server.url) as aclient:
            return await aclient.cancel("done"), await aclient.status(["done", "never-sent-3"])

    cancelled, status = asyncio.run(asynchronously())
    assert cancelled["done"].state == "too_late" and [s.state for s in status.values()] == ["answered", "unknown"]


def test_another_tenants_credential_cannot_cancel(tmp_path):
    """Two namespaces, each with its own producer user (ops/redis_acl.py's rules for each): one cannot reach the
    other's records or cancel function keys."""
    from ops.redis_acl import CONNECT, ROLES, patterns
    from producer.local.server import RedisServer

    with RedisServer() as server:
        admin = redis.Redis(port=server.port)
        library_loader.ensure(admin)
        for namespace in ("alpha", "beta"):
            rules = ROLES["producer"].format(connect=CONNECT, **patterns(namespace))
            admin.execute_command("ACL", "SETUSER", f"producer-{namespace}", "on", f">{namespace}-pw", "resetkeys",
                                  "resetchannels", "-@all", *rules.split())
        alpha = Client(f"redis://producer-alpha:alpha-pw@127.0.0.1:{server.port}/0", namespace="alpha")
        beta = Client(f"redis://producer-beta:beta-pw@127.0.0.1:{server.port}/0", namespace="alpha")
        alpha.submit(request("theirs"))
        with pytest.raises(redis.exceptions.NoPermissionError):
            beta.cancel("theirs")
        with pytest.raises(redis.exceptions.NoPermissionError):
            beta.status("theirs")
        assert not admin.hget(Keys("alpha").record("theirs"), Record.CANCELLED)  # not marked
        assert alpha.cancel("theirs")["theirs"].state == "cancelled"  # its own producer may
