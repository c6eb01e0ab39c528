"""dq-producer through subprocess against a real redis-server (and a real worker where results are needed): one
record or result per input line, the summary, exit codes, backpressure that never hangs, connection errors."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from producer.client import Client
from producer.local.ports import free_port
from producer.plumbing.connection import SOCKET_TIMEOUT
from producer.wire.keys import Keys, shard_of

pytestmark = pytest.mark.redis
ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = {"refund": {"type": "noul", "instructions": "Is a refund requested?"},
             "tone": {"type": "choice", "criteria": {"calm": None, "angry": None}}}


def good(request_id: str | None = None, **extra) -> str:
    request = {"state": f"Please refund me ({request_id}).", "questions": QUESTIONS, **extra}
    return json.dumps({"id": request_id, **request} if request_id else request)


def cli(*args: str, env: dict[str, str] | None = None, stdin: str | None = None, timeout: float = 180):
    return subprocess.run([sys.executable, "-m", "producer", *args], capture_output=True, text=True, input=stdin,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def write(path: Path, *lines: str) -> str:
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.slow
def test_submit_wait_writes_one_result_per_line_in_order_and_exits_1_on_errors(served, tmp_path):
    source = write(tmp_path / "in.jsonl", good("w-1"), good(), good("w-late", deadline_ms=1), "{broken", "",
                   json.dumps({"id": "w-noq", "state": "x"}), good("w-6"))
    done = cli("submit", source, "--redis-url", served.url, "--wait", "--ordered", "--timeout", "120")
    assert done.returncode == 1, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["id"] for r in results][:1] + [r["id"] for r in results][2:] == ["w-1", "w-late", "line 4", "w-noq",
                                                                               "w-6"]
    assert re.fullmatch(r"[0-9a-f]{32}", results[1]["id"])  # the generated id, in its line's place
    assert [r["status"] for r in results] == ["ok", "ok", "error", "error", "error", "ok"]
    assert set(results[0]["answers"]) == set(results[0]["logits"]) == set(results[0]["options"]) == set(QUESTIONS)
    assert [r["error"]["code"] for r in results[2:5]] == ["deadline_exceeded", "invalid_json", "invalid_request"]
    assert results[3]["error"]["message"].startswith("line 4: not JSON")
    assert results[4]["error"]["message"] == "line 6: questions: Field required"
    assert "line 4: not JSON" in done.stderr and "line 6: questions: Field required" in done.stderr
    assert done.stderr.splitlines()[-1] == ("6 requests: 3 ok, 3 errors "
                                            "(deadline_exceeded 1, invalid_json 1, invalid_request 1)")
    everything_ok = cli("submit", write(tmp_path / "ok.jsonl", good("w-7"), good("w-8")), "--redis", served.url,
                        "--wait", "--out", str(tmp_path / "out.jsonl"), "--quiet")
    assert everything_ok.returncode == 0 and everything_ok.stdout == "", everything_ok.stderr
    assert everything_ok.stderr.splitlines() == ["2 requests: 2 ok"]
    assert {json.loads(line)["id"] for line in (tmp_path / "out.jsonl").read_text().splitlines()} == {"w-7", "w-8"}
    stats = json.loads(cli("stats", "--json", "--redis-url", served.url).stdout)
    assert stats["requests"]["length"] == 0 and stats["workers"] == 1  # answered entries are deleted



def test_stats_watch_draws_the_tables_until_ctrl_c(served):
    """Frame after frame of the streams and the live worker's row (its state and shard from its heartbeat), until
    SIGINT, which ends a watch with 0; once, the same tables."""
    # The worker's heartbeat says "ready" from its first beat after it became ready (beats come every few seconds).
    with Client(served.url) as client:
        deadline = time.monotonic() + 30
        while [beat["state"] for beat in client.stats()["heartbeats"]] != ["ready"]:
            assert time.monotonic() < deadline, client.stats()["heartbeats"]
            time.sleep(0.1)
    # SIGINT as a terminal gives it: a test run started in the background of a script inherits it ignored
    watching = subprocess.Popen([sys.executable, "-m", "producer", "stats", "--watch", "0.2", "--redis-url",
                                 served.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(watching.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(line.startswith("every 0.2 s, ") for line in lines) < 3:
            time.sleep(0.05)
    finally:
        watching.send_signal(signal.SIGINT)
    assert watching.wait(30) == 0, watching.stderr.read()
    reader.join(10)
    frames = "".join(lines).split("every 0.2 s, ")[1:]
    assert len(frames) >= 3, lines
    for frame in frames:
        rows = frame.splitlines()
        assert rows[2].startswith("namespace dq: 1 shard, 1 worker live, 0 dead letters"), frame
        assert rows[4].split() == ["SHARD", "LANE", "REQUESTS", "PENDING", "LAG", "PARTS", "PARTS", "PENDING",
                                   "PARTS", "LAG", "CONSUMERS"]
        [worker] = [row.split() for row in rows if row.startswith("in-process-")]
        assert worker[1:2] + worker[4:6] == ["0", "ready", "0"] and worker[-2:] == ["s", "ago"], frame
    once = cli("stats", "--redis-url", served.url)
    assert once.returncode == 0 and once.stdout.startswith("namespace dq: 1 shard, 1 worker live"), once.stderr


@pytest.mark.slow
def test_a_reused_id_is_answered_id_conflict_never_with_another_requests_answer(served, tmp_path):
    """submit --wait once printed the stored answer of another request under a reused id as ok (exit 0), and the
    same id on two lines of one file gave both lines the first one's answer."""
    first = cli("submit", write(tmp_path / "a.jsonl", good("reused-1")), "--redis", served.url, "--wait")
    assert first.returncode == 0, first.stderr
    other = json.dumps({"id": "reused-1", "state": "Another request entirely.", "questions": QUESTIONS})
    twins = [good("twin-1"), json.dumps({"id": "twin-1", "state": "Not the first line.", "questions": QUESTIONS})]
    done = cli("submit", write(tmp_path / "b.jsonl", other, good("reused-1"), *twins), "--redis", served.url,
               "--wait", "--ordered", "--timeout", "120")
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["id"], r["status"]) for r in results[:2]] == [("reused-1", "error"), ("reused-1", "ok")]
    assert results[0]["error"]["code"] == "id_conflict"
    assert results[1]["answers"] == json.loads(first.stdout)["answers"]  # the same request: its stored answer
    # The twins: whichever the worker published first is answered; the other is told of the conflict.
    assert sorted(r.get("error", {}).get("code", r["status"]) for r in results[2:]) == ["id_conflict", "ok"]
    assert done.returncode == 1 and "2 errors (id_conflict 2)" in done.stderr.splitlines()[-1]

@pytest.mark.slow
def test_submit_without_wait_reports_every_line_and_generated_ids_fetch_their_results(served, tmp_path):
    done = cli("submit", "-", "--redis-url", served.url, stdin="\n".join([good("n-1"), good(), "[1, 2]"]) + "\n")
    assert done.returncode == 1, done.stderr  # a line was refused
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert records[0] == {"line": 1, "id": "n-1"}
    assert records[1]["line"] == 2 and re.fullmatch(r"[0-9a-f]{32}", records[1]["id"])
    assert records[2] == {"line": 3, "id": "line 3", "error": {
        "code": "invalid_json", "message": "line 3: a request is a JSON object, got list"}}
    assert done.stderr.splitlines() == ["line 3: a request is a JSON object, got list",
                                        "3 requests: 2 queued, 1 refused (invalid_json 1)"]
    fetched = cli("result", records[1]["id"], "--wait", "60", "--redis-url", served.url)
    assert fetched.returncode == 0 and json.loads(fetched.stdout)["id"] == records[1]["id"]
    missing = cli("result", "never-sent", "--redis-url", served.url)
    assert missing.returncode == 1 and missing.stderr == "dq-producer: no result for never-sent\n"
    clean = cli("submit", write(tmp_path / "clean.jsonl", good("n-4")), "--redis-url", served.url)
    assert clean.returncode == 0 and clean.stdout == '{"line": 1, "id": "n-4"}\n'


@pytest.mark.slow
def test_a_limit_below_the_batch_size_sends_in_windows_instead_of_hanging(served, tmp_path):
    source = write(tmp_path / "in.jsonl", *(good(f"m-{i}") for i in range(12)))
    done = cli("submit", source, "--redis-url", served.url, "--max-unfinished", "2", "--wait", "--timeout", "120",
               timeout=150)
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[-1] == "12 requests: 12 ok"
    assert sorted(json.loads(line)["id"] for line in done.stdout.splitlines()) == sorted(f"m-{i}" for i in range(12))


def test_a_queue_that_stays_full_ends_with_exit_3_and_names_what_was_not_sent(redis_server, tmp_path):
    """No worker drains this queue: 3 fit under the limit, the other 2 are reported, within the queue timeout."""
    source = write(tmp_path / "in.jsonl", *(good(f"f-{i}") for i in range(5)))
    start = time.monotonic()
    done = cli("submit", source, "--redis-url", redis_server.url, "--max-unfinished", "3", "--queue-timeout", "0.5")
    assert done.returncode == 3, done.stderr
    assert time.monotonic() - start < 10
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert records[:3] == [{"line": i + 1, "id": f"f-{i}"} for i in range(3)]
    assert [r["error"]["code"] for r in records[3:]] == ["not_sent", "not_sent"]
    assert "queue full for 0.5 s (shard 0, normal lane: 3 unfinished entries, limit 3" in records[3]["error"]["message"]
    assert done.stderr.splitlines()[-1] == "5 requests: 3 queued, 2 not sent"
    assert Client(redis_server.url).redis.xlen(Keys().requests) == 3
    waited = cli("submit", source, "--redis-url", redis_server.url, "--max-unfinished", "3", "--queue-timeout", "0",
                 "--wait", "--timeout", "1")
    assert waited.returncode == 3 and waited.stderr.splitlines()[-1] == "5 requests: 0 ok, 5 not sent"


def _interrupt(args: list[str], ready) -> subprocess.CompletedProcess:
    """Start dq-producer, send SIGINT once ``ready()`` holds, and collect what it wrote."""
    # SIGINT as a terminal gives it: a test run started in the background of a script inherits it ignored
    proc = subprocess.Popen([sys.executable, "-m", "producer", *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)  # into the next step: the queue's backpressure wait, or the wait for results
    for _ in range(20):  # again while it runs: one landing inside a Redis call can be swallowed by the client library
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=0.5)
            break
        except subprocess.TimeoutExpired:
            pass
    out, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def test_ctrl_c_during_submit_prints_every_lines_record_and_exits_130(redis_server, tmp_path):
    """Issue "ordinary faults" 7: interrupted while the queue is full, what went in is named by its receipt, the
    rest is not sent; interrupted while waiting, the queued requests get a result saying they stay queued."""
    source = write(tmp_path / "in.jsonl", *(good(f"c-{i}") for i in range(6)))
    length = Client(redis_server.url).redis.xlen
    done = _interrupt(["submit", source, "--redis-url", redis_server.url, "--max-unfinished", "2", "--batch", "2",
                       "--queue-timeout", "60"], ready=lambda: length(Keys().requests) == 2)
    assert done.returncode == 130, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert records[:2] == [{"line": 1, "id": "c-0"}, {"line": 2, "id": "c-1"}]
    assert [(r["line"], r["error"]["code"]) for r in records[2:]] == [(n, "not_sent") for n in range(3, 7)]
    assert "interrupted" in done.stderr and done.stderr.splitlines()[-1] == "6 requests: 2 queued, 4 not sent"
    assert length(Keys().requests) == 2

    waiting = write(tmp_path / "wait.jsonl", good("w-0"), "{", good("w-1"))
    done = _interrupt(["submit", waiting, "--redis-url", redis_server.url, "--wait", "--ordered", "--timeout", "60"],
                      ready=lambda: length(Keys().requests) == 4)
    assert done.returncode == 130, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["id"], r["error"]["code"]) for r in results] == [
        ("w-0", "timeout"), ("line 2", "invalid_json"), ("w-1", "timeout")]
    assert "stays queued (dq-producer result w-0)" in results[0]["error"]["message"]


def test_a_line_that_is_not_utf8_is_refused_alone_by_its_number(redis_server, tmp_path):
    """Issue "ordinary faults" 8 and 12: the rest of the file is sent; the refused line's name is no real id."""
    source = tmp_path / "in.jsonl"
    bad = b'{"state": "caf\xe9"}'
    at = bad.index(b"\xe9") + 1
    source.write_bytes(good("line-2").encode() + b"\n" + bad + b"\n" + good("u-3").encode() + b"\n")
    done = cli("submit", str(source), "--redis-url", redis_server.url)
    assert done.returncode == 1, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert records[0] == {"line": 1, "id": "line-2"} and records[2] == {"line": 3, "id": "u-3"}
    assert records[1]["id"] == "line 2" and records[1]["error"]["code"] == "invalid_json"
    assert records[1]["error"]["message"] == f"line 2: not UTF-8 (byte {at} of the line)"
    assert Client(redis_server.url).redis.xlen(Keys().requests) == 2


def test_results_that_do_not_come_time_out_with_exit_1(redis_server, tmp_path):
    source = write(tmp_path / "in.jsonl", good("t-1"), good("t-2"))
    start = time.monotonic()
    done = cli("submit", source, "--redis-url", redis_server.url, "--wait", "--timeout", "1", "--ordered")
    assert done.returncode == 1 and time.monotonic() - start < 15, done.stderr
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["id"], r["error"]["code"]) for r in results] == [("t-1", "timeout"), ("t-2", "timeout")]
    assert "2 results missing after 1 s" in done.stderr
    assert done.stderr.splitlines()[-1] == "2 requests: 0 ok, 2 timed out"


def test_a_wrong_url_is_one_line_within_the_socket_timeout(tmp_path):
    unused = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"
    for args in (["stats"], ["submit", write(tmp_path / "in.jsonl", good("u-1"))], ["result", "x"]):
        start = time.monotonic()
        done = cli(*args, "--redis-url", unused, timeout=30)
        assert done.returncode == 4 and time.monotonic() - start < SOCKET_TIMEOUT, (args, done.stderr)
        assert done.stdout == "" and len(done.stderr.splitlines()) == 1 and "s3cret" not in done.stderr
        assert done.stderr.startswith("dq-producer: Redis at redis://user:***@127.0.0.1:") and \
            "Connection refused" in done.stderr
    for args, message in ((["stats", "--redis-url", "localhost:6379"], "a Redis URL starts with redis://"),
                          (["submit", str(tmp_path / "absent.jsonl")], "No such file or directory"),
                          (["stats", "--shards", "0"], "shards must be at least 1")):
        done = cli(*args, timeout=30)
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and message in done.stderr, done.stderr


def test_the_workers_connection_vocabulary_and_shards(redis_server, tmp_path):
    env = {"DQ_REDIS_URL": redis_server.url, "DQ_NAMESPACE": "shop", "DQ_SHARDS": "3"}
    done = cli("submit", write(tmp_path / "in.jsonl", *(good(f"s-{i}") for i in range(12))), env=env)
    assert done.returncode == 0, done.stderr
    connection = Client(redis_server.url).redis
    lengths = [connection.xlen(Keys("shop", shard).requests) for shard in range(3)]
    assert lengths == [sum(shard_of(f"s-{i}", 3) == shard for i in range(12)) for shard in range(3)]
    assert all(lengths)
    stats = json.loads(cli("stats", "--json", env=env).stdout)
    assert stats["requests"]["length"] == 12 and [s["requests"]["length"] for s in stats["shards"]] == lengths
    # the flags win over the environment; --redis is kept as an alias of --redis-url
    one = json.loads(cli("stats", "--json", "--redis", redis_server.url, "--shards", "1", "--namespace", "shop",
                         env={"DQ_REDIS_URL": "redis://127.0.0.1:1/0"}).stdout)
    assert [s["shard"] for s in one["shards"]] == [0] and one["requests"]["length"] == lengths[0]
