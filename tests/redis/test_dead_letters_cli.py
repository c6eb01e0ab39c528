"""``dq-producer dead`` against a real server under the ACL users, dead letters written as workers write them:
list with reasons, requeue to the stream and lane they came from (the dead_lettered result deleted so that the new
answer lands), purge; only the admin user may, and others are told so."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from ops.redis_acl import ROLES, render
from producer.local.server import RedisServer
from producer.wire.keys import HIGH, NORMAL, Field, Keys
from producer.wire.result import Result
from producer.wire.schema import ErrorCode

pytestmark = pytest.mark.redis
ROOT = Path(__file__).resolve().parents[2]
PASSWORDS = {role: f"test-{role}-password" for role in ROLES}


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "producer", "dead", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=os.environ)


def dead_letter(admin: redis.Redis, keys: Keys, fields: dict, stream: str, lane: str, reason: str) -> str:
    """As worker/loop/publisher.py writes one: the entry's fields, then where it was and why. A millisecond apart: entry
    ids of two shards' streams made in the same one would be equal (a case the test makes on purpose below)."""
    time.sleep(0.002)
    return admin.xadd(keys.dead, {**fields, Field.STREAM: stream, Field.LANE: lane, Field.ENTRY_ID: "1-1",
                                  Field.DELIVERIES: "6", Field.REASON: reason}).decode()


def test_dead_letters_are_listed_requeued_and_purged_by_the_admin_only(tmp_path):
    acl = tmp_path / "users.acl"
    acl.write_text(render(PASSWORDS))
    with RedisServer("--aclfile", str(acl)) as server:
        url = {role: f"redis://{role}:{PASSWORDS[role]}@127.0.0.1:{server.port}/0" for role in ROLES}
        admin = redis.Redis.from_url(url["admin"])
        s0, s1 = Keys("dq", 0), Keys("dq", 1)
        body = json.dumps({"id": "r-1", "state": "x", "questions": {"q": {"type": "noul"}}})
        crashed = dead_letter(admin, s0, {"body": body}, "requests", str(HIGH), "worker crashed 6 times")
        answered_dead = Result.failure("r-1", ErrorCode.DEAD_LETTERED, "delivered 6 times").model_dump_json()
        admin.xadd(s0.result("r-1"), {"body": answered_dead})
        hostile = dead_letter(admin, s1, {"body": b"\xff\xfe not json", "extra\n": "x"}, "requests", str(NORMAL),
                              "forward failed: CUDA error")
        part = dead_letter(admin, s1, {"request_id": "big", "part": "0"}, "chunks", str(NORMAL), "no request")
        ok_body = json.dumps({"id": "r-ok", "state": "y", "questions": {"q": {"type": "noul"}}})
        answered = dead_letter(admin, s0, {"body": ok_body}, "requests", str(NORMAL), "slow")
        admin.xadd(s0.result("r-ok"), {"body": Result.model_validate(
            {"id": "r-ok", "status": "ok"}).model_dump_json()})

        listed = cli("list", "--redis-url", url["admin"], "--shards", "2")
        assert listed.returncode == 0, listed.stderr
        records = {r["dead_id"]: r for r in map(json.loads, listed.stdout.splitlines())}
        assert set(records) == {crashed, hostile, part, answered}
        assert records[crashed] | {"dead_at": None} == {
            "dead_id": crashed, "shard": 0, "stream": "requests", "lane": "high", "entry_id": "1-1",
            "deliveries": "6", "reason": "worker crashed 6 times", "request_id": "r-1", "dead_at": None}
        assert records[hostile]["reason"] == "forward failed: CUDA error" and records[hostile]["request_id"] is None
        assert "fields" not in records[crashed]  # payloads only when asked
        bodies = json.loads(cli("list", "--bodies", "--redis-url", url["admin"]).stdout.splitlines()[0])
        assert bodies["fields"] == {"body": body}

        for role in ("monitor", "worker", "producer"):  # payloads and writes: the admin's alone
            refused = cli("list", "--redis-url", url[role])
            assert refused.returncode == 1 and "need the admin user" in refused.stderr, (role, refused.stderr)

        # each shard's stream numbers its own entries: an id in two shards is not guessed at
        admin.xadd(s0.dead, {"stream": "requests"}, id="9999999999999-5")
        admin.xadd(s1.dead, {"stream": "requests"}, id="9999999999999-5")
        requeued = cli("requeue", crashed, answered, "9-9", "9999999999999-5", "--redis-url", url["admin"], "--shards", "2")
        assert requeued.returncode == 1, requeued.stderr  # some were skipped, and said why
        outcomes = {o["dead_id"]: o for o in map(json.loads, requeued.stdout.splitlines())}
        assert outcomes[crashed] == {"dead_id": crashed, "requeued": s0.requests_in(HIGH), "request_id": "r-1"}
        assert "is answered (ok)" in outcomes[answered]["skipped"]
        assert outcomes["9-9"]["skipped"] == "no such dead letter"
        assert outcomes["9999999999999-5"]["skipped"] == "in shards 0, 1: say which with --shard"
        assert requeued.stderr.splitlines()[-1] == "4 dead letters: 1 requeued, 3 skipped"
        one = cli("requeue", part, "--shard", "1", "--redis-url", url["admin"], "--shards", "2")
        assert "submit the request again" in json.loads(one.stdout)["skipped"]
        [(_, fields)] = admin.xrange(s0.requests_in(HIGH))
        assert fields == {b"body": body.encode()}  # the entry as it was, without the dead letter's own fields
        assert admin.exists(s0.result("r-1")) == 0  # the new answer will be the one published
        assert admin.exists(s0.result("r-ok")) == 1

        assert cli("requeue", "--redis-url", url["admin"]).returncode == 2  # ids or --all
        for action in ("requeue", "purge"):  # not an entry id: usage (2), where Redis' refusal read as unreachable (4)
            bad = cli(action, crashed, "nope", "--redis-url", url["admin"])
            assert bad.returncode == 2 and "'nope' is not a dead-letter id" in bad.stderr and not bad.stdout, bad.stderr
        purged = cli("purge", "--all", "--redis-url", url["admin"], "--shards", "2")
        assert purged.returncode == 0 and purged.stderr.splitlines()[-1] == "5 dead letters: 5 purged"
        assert admin.xlen(s0.dead) == admin.xlen(s1.dead) == 0


def test_a_requeue_never_runs_between_a_dead_letter_and_its_result(redis_server, inprocess):
    """Poison requests dead-lettered at their first failure while a requeue loop takes every dead letter back: the
    worker wrote the dead letter before its dead_lettered result, so a requeue in between deleted the dead letter
    and found no result to delete; the result landed after, the requeued entry was answered as its replay, and the
    request stayed dead_lettered with no dead letter left to requeue (13 of 30). Now the dead letter and its result
    are one step, and the requeue one step that waits for the entry's acknowledgement: at the end every request is
    dead_lettered with its dead letter there."""
    from producer.admin.dead_letters import entries, requeue_one
    from producer.client import Client

    worker = inprocess(redis_server.url, raise_on="POISON", max_deliveries=1).start()
    client = Client(redis_server.url)
    keys = Keys()
    ids = client.submit_many([{"id": f"poison-{i}", "state": f"POISON {i}", "questions": {"q": {"type": "noul"}}}
                              for i in range(30)])
    requeued, stop = [0], time.monotonic() + 8
    while time.monotonic() < stop:  # as fast as the tool can: every dead letter back, again and again
        for dead_id, fields in list(entries(client.redis, keys)):
            requeued[0] += "requeued" in requeue_one(client.redis, keys, dead_id, fields)
    deadline = time.monotonic() + 60
    while client.redis.xlen(keys.requests) or worker.metric("dq_inflight_entries"):  # the last ones settle
        assert time.monotonic() < deadline, "the worker did not settle"
        time.sleep(0.05)
    worker.stop()
    dead = {json.loads(fields[b"body"])["id"] for _, fields in client.redis.xrange(keys.dead)}
    results = {request_id: stored_code(client, request_id) for request_id in ids}
    assert set(results.values()) == {"dead_lettered"}, results
    assert dead == set(ids), sorted(set(ids) - dead)  # each one can still be requeued
    assert requeued[0] > 30  # and the race was run: each requeued at least once


def stored_code(client, request_id: str) -> str | None:
    entry = client.redis.xrange(client.keys.result(request_id), count=1)
    return json.loads(entry[0][1][b"body"])["error"]["code"] if entry else None
