"""Redis ACL users (ops/redis_acl.py) loaded into a real server, tried as each role: every forbidden action is
refused (the busy-loop Lua included), every needed one allowed, and the daemon, the producer and the monitor run
a whole end to end under their own users without a single denial. docs/RELIABILITY.md cites each test here."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from faults import wait_for
from ops.redis_acl import ROLES, render
from producer.client import Client, LibraryUnavailable
from producer.local.ports import free_port
from producer.local.server import RedisServer
from producer.plumbing import library_loader
from producer.wire import library
from producer.wire.keys import HIGH, Keys
from support import http_get
from test_e2e import QUESTIONS, requests

pytestmark = [pytest.mark.redis]
ROOT = Path(__file__).resolve().parents[2]
PASSWORDS = {role: f"test-{role}-password" for role in ROLES}
KEYS = Keys()
SPIN = "#!lua name=spin\nredis.register_function('spin', function() while true do end end)"
MAX_ID = "18446744073709551615-18446744073709551615"


@pytest.fixture
def acl_server(tmp_path):
    path = tmp_path / "users.acl"
    path.write_text(render(PASSWORDS))
    with RedisServer("--aclfile", str(path)) as server:
        yield server


@pytest.fixture
def prepared(acl_server):
    """The server as an admin sets it up: the function library loaded, the group on a work stream with one entry
    in it, a published result."""
    admin = connect(acl_server, "admin")
    assert library_loader.ensure(admin).action == "loaded"
    admin.xgroup_create(KEYS.requests, KEYS.group, id="0", mkstream=True)
    admin.xadd(KEYS.requests, {"body": json.dumps({"id": "secret", "state": "a private state", "questions": {}})})
    admin.xadd(KEYS.result("done"), {"body": "{}"})
    admin.hset(KEYS.shares("half"), "0", '{"answers": "private"}')
    admin.set(KEYS.body("half"), "a private body")
    admin.acl_log_reset()
    return admin



def test_a_restart_keeps_every_write_of_a_function_and_nobody_gets_in_without_a_role(acl_server):
    """Redis 7.0 to 8.2 replay a MULTI block of the AOF under the default user's rules (redis/redis#14541): a
    restricted default user drops, at a restart, the writes of every function call that made several. The
    project's default user is off and allows every command: the restart keeps them, and no client can be it."""
    admin = connect(acl_server, "admin")
    assert library_loader.ensure(admin).action == "loaded"
    ids = Client(url(acl_server, "producer")).submit_many(requests(3, "restart"))  # XADD, HSET and EXPIRE each
    records = {request_id: admin.hgetall(KEYS.record(request_id)) for request_id in ids}
    assert all(records.values())
    acl_server.stop()
    acl_server.start()  # answers NOAUTH at once, even while it still loads the AOF
    admin = connect(acl_server, "admin")
    wait_for(lambda: admin.info("persistence")["loading"] == 0, what="the AOF loaded")
    assert admin.xlen(KEYS.requests) == 3
    assert {request_id: admin.hgetall(KEYS.record(request_id)) for request_id in ids} == records
    assert admin.acl_log() == []
    with pytest.raises(redis.AuthenticationError):  # NOAUTH: the default user is off
        connect(acl_server, None).ping()

def url(server: RedisServer, role: str) -> str:
    return f"redis://{role}:{PASSWORDS[role]}@127.0.0.1:{server.port}/0"


def connect(server: RedisServer, role: str | None) -> redis.Redis:
    return redis.Redis.from_url(url(server, role) if role else server.url)


def refused(call, *args, **kwargs) -> bool:
    try:
        call(*args, **kwargs)
    except redis.ResponseError as error:  # NOPERM, or a command a function ran refused (wording differs by server)
        text = str(error).lower()
        return "permission" in text or "user executing the script can't" in text
    return False


def command(client: redis.Redis, *args):
    return lambda: client.execute_command(*args)


def lua_refused(client: redis.Redis) -> None:
    """No Lua of its own: a busy loop would make every other client BUSY until an admin killed it."""
    for attempt in (command(client, "EVAL", "while true do end", 0), command(client, "SCRIPT", "LOAD", "return 1"),
                    command(client, "EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", 0),
                    command(client, "FUNCTION", "LOAD", SPIN), command(client, "FUNCTION", "FLUSH"),
                    command(client, "FUNCTION", "DELETE", library.LIBRARY), command(client, "SCRIPT", "FLUSH")):
        assert refused(attempt)


def test_producer_submits_through_the_function_reads_results_and_nothing_else(acl_server, prepared):
    admin = prepared
    producer = connect(acl_server, "producer")
    Client(url(acl_server, "producer")).submit({"id": "p-1", "state": "x", "questions": QUESTIONS})  # FCALL
    client = Client(url(acl_server, "producer"))
    client.submit({"id": "p-2", "state": "x", "questions": QUESTIONS, "priority": "high"})  # the high lane's stream
    producer.xadd(KEYS.requests_in(HIGH), {"body": "{}"})  # a plain XADD there too
    assert admin.xlen(KEYS.requests_in(HIGH)) == 2
    assert producer.xrange(KEYS.result("done")) and producer.xread({KEYS.result("done"): "0-0"})
    assert producer.xread({KEYS.reply_prefix + "mine": "0-0"}) == []
    # the gateway (this user): a System One call's retries mapped to its request
    assert producer.set(KEYS.call("c1"), "an-id digest", nx=True, px=60000) and producer.get(KEYS.call("c1"))
    assert producer.delete(KEYS.call("c1")) == 1
    lua_refused(producer)
    # The submit function takes no stream id: its argument is a request id, and an entry id's shape is refused.
    assert "INVALID" in str(pytest.raises(redis.ResponseError, producer.fcall, library.SUBMIT, 1, KEYS.requests,
                                          0, MAX_ID, "{}").value)
    for attempt in [
        # other producers' requests: no reading them, consuming, deleting or trimming them
        command(producer, "XRANGE", KEYS.requests, "-", "+"), command(producer, "XREAD", "STREAMS", KEYS.requests, 0),
        command(producer, "XINFO", "STREAM", KEYS.requests), command(producer, "XREADGROUP", "GROUP", KEYS.group, "me",
                                                                       "STREAMS", KEYS.requests, ">"),
        command(producer, "XACK", KEYS.requests, KEYS.group, "1-0"), command(producer, "XDEL", KEYS.requests, "1-0"),
        command(producer, "XTRIM", KEYS.requests, "MAXLEN", 0), command(producer, "DEL", KEYS.requests),
        command(producer, "SET", KEYS.requests, 1), command(producer, "XSETID", KEYS.requests, MAX_ID),
        command(producer, "XGROUP", "DESTROY", KEYS.requests, KEYS.group),
        # no forged answers: not by XADD, not through the worker's functions
        command(producer, "XADD", KEYS.result("forged"), "*", "body", "{}"),
        command(producer, "FCALL", library.PUBLISH, 3, KEYS.result("forged"), KEYS.shares("forged"),
                KEYS.body("forged"), "{}", 60),
        command(producer, "FCALL", library.PART, 2, KEYS.shares("half"), KEYS.result("half"), 1, 2, "{}", 60),
        command(producer, "XADD", KEYS.parts, "*", "x", 1), command(producer, "XADD", KEYS.reply_prefix + "x", "*",
                                                                        "x", 1),
        command(producer, "HGETALL", KEYS.shares("half")), command(producer, "GET", KEYS.body("half")),
        command(producer, "XLEN", KEYS.dead), command(producer, "DEL", KEYS.result("done")),
        command(producer, "SET", "elsewhere", 1), command(producer, "KEYS", "*"), command(producer, "SCAN", 0),
        command(producer, "FLUSHALL"), command(producer, "CONFIG", "GET", "*"), command(producer, "MONITOR")]:
        assert refused(attempt)
    assert admin.ping() and admin.xlen(KEYS.requests) == 2 and not admin.exists(KEYS.result("forged"))
    assert refused(command(producer, "XRANGE", KEYS.requests_in(HIGH), "-", "+"))
    assert refused(command(producer, "XADD", KEYS.parts_in(HIGH), "*", "x", 1))


def test_the_submit_function_needs_the_xadd_a_producer_could_also_call_itself(acl_server, prepared):
    """Redis checks each command a function runs against its caller: without XADD, FCALL cannot enqueue. So the
    producer role keeps XADD, and a leaked producer credential can XADD an entry id of its choosing (the
    documented limit, docs/OPERATIONS.md); this is the admin's repair once its poisoned stream drained."""
    admin = prepared
    admin.execute_command("ACL", "SETUSER", "no-xadd", "on", ">pw", "resetkeys", "-@all", "+fcall", "+xlen",
                          f"~{Keys('dq', '*').requests}")
    no_xadd = redis.Redis(port=acl_server.port, username="no-xadd", password="pw")
    assert refused(no_xadd.fcall, library.SUBMIT, 1, KEYS.requests, 0, "a", "{}")

    producer = connect(acl_server, "producer")
    producer.xadd(KEYS.requests, {"body": "{}"}, id=MAX_ID)
    with pytest.raises(redis.ResponseError, match="exhausted"):
        Client(url(acl_server, "producer")).submit({"id": "after", "state": "x", "questions": QUESTIONS})
    # Workers drain it (deleted here), then one transaction recreates stream and group: new ids from now on.
    for entry_id, _ in admin.xrange(KEYS.requests):
        admin.xdel(KEYS.requests, entry_id)
    with admin.pipeline(transaction=True) as repair:
        repair.delete(KEYS.requests).xgroup_create(KEYS.requests, KEYS.group, id="0", mkstream=True).execute()
    Client(url(acl_server, "producer")).submit({"id": "after", "state": "x", "questions": QUESTIONS})
    assert admin.xinfo_groups(KEYS.requests)[0]["lag"] == 1


def test_worker_cannot_replace_delete_or_trim_a_work_stream(acl_server, prepared):
    admin = prepared
    worker = connect(acl_server, "worker")
    lua_refused(worker)
    for stream in (KEYS.requests, KEYS.parts, KEYS.requests_in(HIGH), KEYS.parts_in(HIGH), KEYS.dead):
        for attempt in [command(worker, "SET", stream, 1), command(worker, "DEL", stream),
                        command(worker, "UNLINK", stream), command(worker, "EXPIRE", stream, 1),
                        command(worker, "PEXPIRE", stream, 1), command(worker, "RENAME", stream, KEYS.body("x")),
                        command(worker, "RENAME", KEYS.body("half"), stream), command(worker, "XTRIM", stream,
                                                                                       "MAXLEN", 0),
                        command(worker, "XSETID", stream, MAX_ID), command(worker, "XGROUP", "DESTROY", stream,
                                                                           KEYS.group),
                        command(worker, "XGROUP", "SETID", stream, KEYS.group, "$"),
                        command(worker, "HSET", stream, "x", 1),
                        # the worker's own functions cannot be pointed at a work stream either
                        command(worker, "FCALL", library.PUBLISH, 3, stream, KEYS.shares("x"), KEYS.body("x"), "{}",
                                60),
                        command(worker, "FCALL", library.PUBLISH, 3, KEYS.result("x"), stream, KEYS.body("x"), "{}",
                                60)]:
            assert refused(attempt)
    for attempt in [command(worker, "XADD", KEYS.requests, "*", "body", "{}"),  # workers do not submit
                    command(worker, "FCALL", library.SUBMIT, 1, KEYS.requests, 0, "w", "{}"),
                    command(worker, "SET", KEYS.result("done"), 1), command(worker, "DEL", KEYS.result("done")),
                    command(worker, "SET", "other:key", 1), command(worker, "GET", "other:key"),
                    command(worker, "FLUSHALL"), command(worker, "FLUSHDB"), command(worker, "KEYS", "*"),
                    command(worker, "CONFIG", "SET", "appendonly", "no"), command(worker, "ACL", "LIST"),
                    command(worker, "SHUTDOWN", "NOSAVE"), command(worker, "MONITOR")]:
        assert refused(attempt)
    # What the daemon does on per-request keys is allowed (the end to end below runs all of it).
    assert worker.fcall(library.PUBLISH, 3, KEYS.result("w"), KEYS.shares("w"), KEYS.body("w"), "{}", 60) == 1
    assert worker.delete(KEYS.shares("half"), KEYS.body("half")) == 2
    assert admin.type(KEYS.requests) == b"stream" and admin.xinfo_groups(KEYS.requests)[0]["name"] == b"workers"
    assert admin.type(KEYS.parts) == b"none" and admin.type(KEYS.dead) == b"none"


def test_monitor_sees_counts_not_payloads(acl_server, prepared):
    monitor = connect(acl_server, "monitor")
    assert monitor.xlen(KEYS.requests) == 1 and monitor.xinfo_groups(KEYS.requests)[0]["lag"] == 1
    assert monitor.xlen(KEYS.requests_in(HIGH)) == 0 and monitor.xlen(KEYS.parts_in(HIGH)) == 0
    assert monitor.xpending(KEYS.requests, KEYS.group)["pending"] == 0 and "redis_version" in monitor.info()
    assert monitor.xpending_range(KEYS.requests, KEYS.group, "-", "+", 10) == []
    assert monitor.xinfo_consumers(KEYS.requests, KEYS.group) == [] and monitor.hgetall(KEYS.workers()) == {}
    lua_refused(monitor)
    for attempt in [command(monitor, "XINFO", "STREAM", KEYS.requests),  # its first and last entries, bodies
                    command(monitor, "XINFO", "STREAM", KEYS.requests, "FULL"),
                    command(monitor, "XRANGE", KEYS.requests, "-", "+"),
                    command(monitor, "XREVRANGE", KEYS.requests, "+", "-"),
                    command(monitor, "XREAD", "STREAMS", KEYS.requests, 0),
                    command(monitor, "XREADGROUP", "GROUP", KEYS.group, "me", "STREAMS", KEYS.requests, ">"),
                    command(monitor, "XRANGE", KEYS.result("done"), "-", "+"),
                    command(monitor, "HGETALL", KEYS.shares("half")), command(monitor, "GET", KEYS.body("half")),
                    command(monitor, "XADD", KEYS.requests, "*", "body", "{}"), command(monitor, "DEL", "x"),
                    command(monitor, "FCALL", library.SUBMIT, 1, KEYS.requests, 0, "m", "{}"),
                    command(monitor, "CONFIG", "GET", "*"), command(monitor, "FLUSHALL"), command(monitor, "MONITOR"),
                    command(monitor, "SLOWLOG", "GET", "1"),  # the slow commands' arguments: bodies
                    command(monitor, "LATENCY", "RESET"), command(monitor, "SLOWLOG", "RESET")]:
        assert refused(attempt)
    # what redis_exporter reads of Redis itself: counts, never an entry
    assert monitor.slowlog_len() >= 0 and command(monitor, "LATENCY", "LATEST")() is not None
    assert command(monitor, "LATENCY", "HISTOGRAM", "info")() is not None

    anonymous = connect(acl_server, None)  # the default user is off: nothing without a role, PING included
    for call in (anonymous.ping, lambda: anonymous.xlen(KEYS.requests), lambda: anonymous.get("x")):
        with pytest.raises(redis.AuthenticationError):
            call()
    assert monitor.ping()  # the compose health check's: as the monitor user


EXPORTER = shutil.which("redis_exporter") or shutil.which("prometheus-redis-exporter")


@pytest.mark.skipif(EXPORTER is None, reason="no redis_exporter (Debian: apt-get install prometheus-redis-exporter)")
def test_redis_exporter_reads_every_series_the_redis_alerts_name_as_the_monitor_user(acl_server, prepared, tmp_path):
    """redis_exporter as compose and Kubernetes run it (the monitor user, --config-command=-): Redis is up to it,
    every series the rules of ops/prometheus/redis.yml read is there (maxclients comes from INFO from release 1.68
    on, older ones read it from CONFIG, which the monitor may not), and the server refused it nothing but the slow
    log's entries."""
    port = free_port()
    exporter = subprocess.Popen([EXPORTER, "--web.listen-address", f"127.0.0.1:{port}", "--include-system-metrics",
                                 "--config-command=-", "--redis.addr", f"redis://127.0.0.1:{acl_server.port}",
                                 "--redis.user", "monitor"], env={"REDIS_PASSWORD": PASSWORDS["monitor"]},
                                stdout=subprocess.DEVNULL, stderr=open(tmp_path / "exporter.log", "wb"))
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                status, text = http_get(f"http://127.0.0.1:{port}/metrics")
                break
            except OSError:
                assert exporter.poll() is None and time.monotonic() < deadline, (tmp_path / "exporter.log").read_text()
                time.sleep(0.1)
    finally:
        exporter.terminate()
        exporter.wait(10)
    samples = {sample.name: sample for family in text_string_to_metric_families(text) for sample in family.samples}
    assert status == 200 and samples["redis_up"].value == 1
    rules = yaml.safe_load((ROOT / "ops/prometheus/redis.yml").read_text())["groups"][0]["rules"]
    named = {name for rule in rules for name in re.findall(r"\b(redis_[a-z_]+)", rule["expr"])}
    version = tuple(int(part) for part in re.findall(r"\d+", samples["redis_exporter_build_info"].labels["version"])[:2])
    # errors_total appears with a first error; master_link_up on a replica
    expected = named - {"redis_errors_total", "redis_master_link_up"} - ({"redis_max_clients"} if version < (1, 68)
                                                                          else set())
    assert expected <= set(samples), expected - set(samples)
    assert samples["redis_instance_info"].labels["maxmemory_policy"] == "noeviction"
    # refused, on purpose, only the last slow command (its arguments may be a body): the exporter then goes without it
    assert {entry["object"] for entry in prepared.acl_log()} <= {"slowlog|get"}


@pytest.mark.slow
def test_daemon_and_producer_run_end_to_end_under_their_users(acl_server, start_worker, tiny_dir):
    admin = connect(acl_server, "admin")
    # A poison entry taken and dropped again and again by a crashing consumer: the worker dead-letters it.
    admin.xgroup_create(KEYS.requests, KEYS.group, id="0", mkstream=True)
    admin.xgroup_create(KEYS.parts, KEYS.group, id="0", mkstream=True)
    poison = admin.xadd(KEYS.requests, {"body": json.dumps({"id": "poison", "state": "x",
                                                             "questions": {"q": {"type": "noul"}}})})
    admin.xreadgroup(KEYS.group, "crashy", {KEYS.requests: ">"})
    for _ in range(5):
        admin.xclaim(KEYS.requests, KEYS.group, "crashy", 0, [poison])
    admin.acl_log_reset()

    # No library on the server yet, and neither the worker nor the producer may load one: both say so.
    worker = start_worker(tiny_dir, url(acl_server, "worker"), ready=False, max_prompt_tokens=220, fanout_tokens=200,
                          claim_idle_ms=300, max_deliveries=5)
    client = Client(url(acl_server, "producer"))
    with pytest.raises(LibraryUnavailable, match="load-functions"):
        client.submit({"id": "early", "state": "x", "questions": QUESTIONS})
    deadline = time.monotonic() + 120
    while "load-functions" not in worker.log.read_text():
        assert time.monotonic() < deadline and worker.process.poll() is None, worker.log.read_text()[-3000:]
        time.sleep(0.2)
    status, body = worker.get("/readyz")
    assert status == 503 and json.loads(body)["library"] is False and json.loads(body)["redis"] is True
    loaded = subprocess.run([sys.executable, "-m", "worker", "load-functions", "--redis-url",
                             url(acl_server, "admin")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert loaded.returncode == 0 and "loaded" in loaded.stdout and PASSWORDS["admin"] not in loaded.stdout
    worker.wait_ready(30)  # it looks again every 5 s
    admin.acl_log_reset()  # the refused loads above

    batch = requests(12, "acl")
    batch.append({"id": "reply", "state": "reply to me", "questions": QUESTIONS,
                  "reply_to": KEYS.reply_prefix + "svc-1"})
    many = {f"q{i}": {"type": "noul", "instructions": f"Is statement {i} true?"} for i in range(20)}
    batch.append({"id": "long", "state": "Some state.", "questions": many})  # fans out: body, prompts, parts
    ids = client.submit_many(batch)
    client.redis.xadd(KEYS.requests, {"body": "{oops"})  # bad input by plain XADD
    results = client.wait_many([*ids, "poison"], timeout=120)
    assert all(results[r].ok for r in ids), [results[r].error for r in ids if not results[r].ok]
    assert results["long"].usage.parts > 1
    assert results["poison"].error.code.value == "dead_lettered"
    # The reply is added right after the result is published: block for it.
    [(_, [(_, reply)])] = client.redis.xread({KEYS.reply_prefix + "svc-1": "0-0"}, count=1, block=4000)
    assert reply[b"id"] == b"reply"

    stats = subprocess.run([sys.executable, "-m", "producer", "stats", "--json", "--redis", url(acl_server, "monitor")],
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
        monitor = redis.Redis(port=port, username="monitor", password=DEVELOPMENT_PASSWORDS["monitor"], retry=None)
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None, (tmp_path / "redis.log").read_text()[-2000:]
            try:
                if monitor.ping():  # the compose health check: PING as the monitor user
                    break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        admin = redis.Redis(port=port, username="admin", password=DEVELOPMENT_PASSWORDS["admin"])
        config = admin.config_get("*")
        assert config["appendonly"] == "yes" and config["appendfsync"] == "always"
        assert config["maxmemory-policy"] == "noeviction" and config["stream-node-max-bytes"] == "1024"
        assert {user.split()[1] for user in admin.acl_list()} == {"default", *ROLES}
        library_loader.ensure(admin)  # compose's redis-setup service
        producer = Client(f"redis://producer:{DEVELOPMENT_PASSWORDS['producer']}@127.0.0.1:{port}/0")
        producer.submit({"id": "c-1", "state": "x", "questions": QUESTIONS})
        with pytest.raises(redis.AuthenticationError):  # no credentials, no command (the default user is off)
            redis.Redis(port=port).xlen(KEYS.requests)
    finally:
        process.kill()
        process.wait(10)
