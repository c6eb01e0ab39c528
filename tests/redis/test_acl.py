"""Redis ACL users (ops/redis_acl.py) loaded into a real redis-server: each role is refused what it must not do,
and the daemon and the producer run a whole end to end under their own users without a single denial."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from ops.redis_acl import ROLES, render
from producer.client import Client
from producer.keys import HIGH, Keys
from test_e2e import QUESTIONS, requests
from worker.redis_server import RedisServer, free_port

pytestmark = [pytest.mark.redis]
ROOT = Path(__file__).resolve().parents[2]
PASSWORDS = {role: f"test-{role}-password" for role in ROLES}
KEYS = Keys()


@pytest.fixture
def acl_server(tmp_path):
    path = tmp_path / "users.acl"
    path.write_text(render(PASSWORDS))
    with RedisServer("--aclfile", str(path)) as server:
        yield server


def url(server: RedisServer, role: str) -> str:
    return f"redis://{role}:{PASSWORDS[role]}@127.0.0.1:{server.port}/0"


def connect(server: RedisServer, role: str | None) -> redis.Redis:
    return redis.Redis.from_url(url(server, role) if role else server.url)


def refused(call, *args, **kwargs) -> bool:
    try:
        call(*args, **kwargs)
    except redis.ResponseError as error:  # NOPERM, or a script's refused command
        return "permission" in str(error).lower() or "can't run this command" in str(error)
    return False


def test_each_role_is_refused_what_it_must_not_do(acl_server):
    admin = connect(acl_server, "admin")
    admin.xgroup_create(KEYS.requests, KEYS.group, id="0", mkstream=True)
    admin.xadd(KEYS.result("done"), {"body": "{}"})
    forge = admin.script_load("return redis.call('XADD', KEYS[1], '*', 'body', 'forged')")

    producer = connect(acl_server, "producer")
    Client(url(acl_server, "producer")).submit({"id": "p-1", "state": "x", "questions": QUESTIONS})  # EVALSHA
    producer.xadd(KEYS.requests, {"body": "{}"})  # a plain XADD, as any language does
    Client(url(acl_server, "producer")).submit({"id": "p-2", "state": "x", "questions": QUESTIONS, "priority": "high"})
    producer.xadd(KEYS.requests_in(HIGH), {"body": "{}"})  # and into the high lane
    assert producer.xrange(KEYS.result("done")) and producer.xread({KEYS.result("done"): "0-0"})
    for call, args in [(producer.xreadgroup, (KEYS.group, "me", {KEYS.requests: ">"})),
                       (producer.xack, (KEYS.requests, KEYS.group, "1-0")), (producer.xdel, (KEYS.requests, "1-0")),
                       (producer.xtrim, (KEYS.requests, 0)), (producer.delete, (KEYS.requests,)),
                       (producer.xadd, (KEYS.result("forged"), {"body": "{}"})),  # no forged answers
                       (producer.xadd, (KEYS.chunks, {"x": "1"})), (producer.xlen, (KEYS.dead,)),
                       (producer.set, ("elsewhere", 1)), (producer.flushall, ()), (producer.config_get, ("*",)),
                       (producer.keys, ("*",)), (producer.eval, ("return 1", 0)),
                       (producer.evalsha, (forge, 1, KEYS.result("forged")))]:
        assert refused(call, *args), call.__name__

    worker = connect(acl_server, "worker")
    for call, args in [(worker.flushall, ()), (worker.flushdb, ()), (worker.config_set, ("appendonly", "no")),
                       (worker.keys, ("*",)), (worker.delete, (KEYS.requests,)), (worker.expire, (KEYS.requests, 1)),
                       (worker.xtrim, (KEYS.requests, 0)), (worker.xgroup_destroy, (KEYS.requests, KEYS.group)),
                       (worker.set, ("other:key", 1)), (worker.acl_list, ()), (worker.eval, ("return 1", 0)),
                       (worker.execute_command, ("SHUTDOWN", "NOSAVE"))]:
        assert refused(call, *args), call.__name__
    assert worker.delete(KEYS.parts("gone"), KEYS.body("gone")) == 0  # what the publish script deletes: allowed

    monitor = connect(acl_server, "monitor")
    assert monitor.xlen(KEYS.requests) == 2 and monitor.xinfo_groups(KEYS.requests)[0]["lag"] == 2
    assert monitor.xpending(KEYS.requests, KEYS.group)["pending"] == 0 and "redis_version" in monitor.info()
    for call, args in [(monitor.xadd, (KEYS.requests, {"body": "{}"})), (monitor.xrange, (KEYS.requests,)),
                       (monitor.xreadgroup, (KEYS.group, "me", {KEYS.requests: ">"})), (monitor.delete, ("x",)),
                       (monitor.evalsha, (forge, 1, KEYS.result("forged"))), (monitor.set, ("x", 1)),
                       (monitor.config_get, ("*",)), (monitor.flushall, ())]:
        assert refused(call, *args), call.__name__

    anonymous = connect(acl_server, None)
    assert anonymous.ping()  # container health checks need no credentials
    assert refused(anonymous.xlen, KEYS.requests) and refused(anonymous.get, "x")
    assert admin.xlen(KEYS.requests) == 2 and admin.xlen(KEYS.requests_in(HIGH)) == 2
    assert not admin.exists(KEYS.result("forged"))


@pytest.mark.slow
def test_daemon_and_producer_run_end_to_end_under_their_users(acl_server, start_worker, tiny_dir):
    admin = connect(acl_server, "admin")
    # A poison entry taken and dropped again and again by a crashing consumer: the worker dead-letters it.
    admin.xgroup_create(KEYS.requests, KEYS.group, id="0", mkstream=True)
    admin.xgroup_create(KEYS.chunks, KEYS.group, id="0", mkstream=True)
    poison = admin.xadd(KEYS.requests, {"body": json.dumps({"id": "poison", "state": "x",
                                                             "questions": {"q": {"type": "noul"}}})})
    admin.xreadgroup(KEYS.group, "crashy", {KEYS.requests: ">"})
    for _ in range(5):
        admin.xclaim(KEYS.requests, KEYS.group, "crashy", 0, [poison])
    admin.acl_log_reset()

    worker = start_worker(tiny_dir, url(acl_server, "worker"), max_chunk_tokens=220, fanout_tokens=200,
                          claim_idle_ms=300, max_deliveries=5)
    client = Client(url(acl_server, "producer"))
    batch = requests(12, "acl")
    batch.append({"id": "reply", "state": "reply to me", "questions": QUESTIONS,
                  "reply_to": KEYS.reply_prefix + "svc-1"})
    many = {f"q{i}": {"type": "noul", "instructions": f"Is statement {i} true?"} for i in range(20)}
    batch.append({"id": "long", "state": "Some state.", "questions": many})  # fans out: body, chunks, parts
    ids = client.submit_many(batch)
    client.redis.xadd(KEYS.requests, {"body": "{oops"})  # bad input by plain XADD
    results = client.wait_many([*ids, "poison"], timeout=120)
    assert all(results[r].ok for r in ids), [results[r].error for r in ids if not results[r].ok]
    assert results["long"].usage.parts > 1
    assert results["poison"].error.code.value == "dead_lettered"
    # The reply is added right after the result is published: block for it.
    [(_, [(_, reply)])] = client.redis.xread({KEYS.reply_prefix + "svc-1": "0-0"}, count=1, block=4000)
    assert reply[b"id"] == b"reply"

    stats = subprocess.run([sys.executable, "-m", "producer", "stats", "--redis", url(acl_server, "monitor")],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert stats.returncode == 0, stats.stderr
    assert json.loads(stats.stdout)["dead_letters"] == 1
    worker.signal(signal.SIGTERM)
    assert worker.wait(60) == 0
    assert admin.hlen(KEYS.workers()) == 0  # it removed its heartbeat on the way out
    assert admin.xlen(KEYS.requests) == 0 and admin.xlen(KEYS.dead) == 1
    # Not one command of the daemon, the producer or the monitor was refused along the way.
    assert admin.acl_log() == [], admin.acl_log()
    assert "permission" not in worker.log.read_text().lower()


def test_the_compose_redis_config_loads_with_its_acl_file(tmp_path):
    """ops/redis/redis.conf and ops/redis/users.acl as compose mounts them (only paths and the port differ)."""
    from ops.redis_acl import DEVELOPMENT_PASSWORDS

    server = RedisServer()
    port = free_port()
    process = subprocess.Popen([server.binary, str(ROOT / "ops/redis/redis.conf"), "--port", str(port),
                                "--bind", "127.0.0.1", "--dir", str(tmp_path),
                                "--aclfile", str(ROOT / "ops/redis/users.acl")],
                               stdout=open(tmp_path / "redis.log", "wb"), stderr=subprocess.STDOUT)
    try:
        anonymous = redis.Redis(port=port, retry=None)
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None, (tmp_path / "redis.log").read_text()[-2000:]
            try:
                if anonymous.ping():  # the compose health check: PING without credentials
                    break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        admin = redis.Redis(port=port, username="admin", password=DEVELOPMENT_PASSWORDS["admin"])
        config = admin.config_get("*")
        assert config["appendonly"] == "yes" and config["appendfsync"] == "always"
        assert config["maxmemory-policy"] == "noeviction" and config["stream-node-max-bytes"] == "1024"
        assert {user.split()[1] for user in admin.acl_list()} == {"default", *ROLES}
        producer = Client(f"redis://producer:{DEVELOPMENT_PASSWORDS['producer']}@127.0.0.1:{port}/0")
        producer.submit({"id": "c-1", "state": "x", "questions": QUESTIONS})
        assert refused(anonymous.xlen, KEYS.requests)
    finally:
        process.kill()
        process.wait(10)
