"""The gateway as the tests run it: a real ``python -m producer.gateway`` process in front of a real server and a real
CPU worker (tiny checkpoint), one stack per server binary, shared by every gateway test module of the session; each
module finds it as the first one did (``Stack.fresh``), so no order of modules changes a result.

The keyed gateway's keys, one per case the tests need: ``acme`` (namespace dq, both lanes), ``acme-normal`` (dq,
normal lane only, 2 requests in flight), ``globex`` (namespace globex: no worker, so its requests stay queued),
``initech`` (globex too, 4 in flight), ``keeper`` (globex too, its hang-ups keep its requests queued),
``kilo`` (namespace kill: the worker-killed test's own workers).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from producer.local.ports import free_port
from producer.local.server import RedisServer
from producer.wire.keys import LANES, Keys

ROOT = Path(__file__).resolve().parents[2]
TOKENS = {name: f"test-token-{name}-0123456789abcdef" for name in ("acme", "acme-normal", "globex", "initech",
                                                                  "keeper", "kilo")}
KEYS = [{"name": "acme", "token": TOKENS["acme"]},
        {"name": "acme-normal", "token": TOKENS["acme-normal"], "lanes": ["normal"], "max_inflight": 2},
        {"name": "globex", "token": TOKENS["globex"], "namespace": "globex"},
        {"name": "initech", "token": TOKENS["initech"], "namespace": "globex", "max_inflight": 4},
        {"name": "keeper", "token": TOKENS["keeper"], "namespace": "globex", "hang_up": "keep"},
        {"name": "kilo", "token": TOKENS["kilo"], "namespace": "kill"}]
# Small limits, so that each refusal is cheap to reach: the tests keep fewer unfinished requests than this in dq.
LIMITS = {"max_body_bytes": 65536, "max_batch": 20, "max_unfinished": 30, "wait_s": 20, "max_wait_s": 60}
QUESTION = {"refund": {"type": "noul", "instructions": "Is a refund requested?"}}


def request(request_id: str | None = None, **fields: object) -> dict:
    body: dict = {"state": f"Refund me, says {request_id}.", "questions": QUESTION, **fields}
    if request_id is not None:
        body["id"] = request_id
    return body


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name]}"}


class GatewayProcess:
    """``python -m producer.gateway`` as a child process on a free port."""

    def __init__(self, redis_url: str, log: Path, keys: list[dict] | None = None, env: dict | None = None,
                 files: int | None = None, **settings: object) -> None:
        """``files``: the process's open-file limit (soft and hard), as a container's ulimit would set it."""
        self.port, self.log = free_port(), log
        args = [sys.executable, "-m", "producer.gateway", "--redis-url", redis_url, "--port", str(self.port)]
        for name, value in settings.items():
            args += ["--" + name.replace("_", "-"), str(value)]
        environ = {k: v for k, v in os.environ.items() if not k.startswith("DQ_")}
        environ.update(PYTHONUNBUFFERED="1", **(env or {}))
        if keys is not None:
            environ["DQ_GATEWAY_API_KEYS"] = json.dumps(keys)
        limit = None if files is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (files, files)))
        self.process = subprocess.Popen(args, cwd=ROOT, env=environ, stdout=open(log, "ab"),
                                        stderr=subprocess.STDOUT, preexec_fn=limit)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_up(self, timeout: float = 60.0) -> GatewayProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gateway exited {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"gateway not up:\n{self.log.read_text()[-3000:]}")

    def client(self, key: str | None = None, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=auth(key) if key else {}, timeout=timeout)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a metric's samples whose labels include ``labels``."""
        from prometheus_client.parser import text_string_to_metric_families

        total = 0.0
        for family in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=5).text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


@dataclass
class Stack:
    """A server, a worker of namespace dq, the keyed gateway and an open one (no keys, loopback)."""

    server: RedisServer
    worker: object
    gateway: GatewayProcess
    open: GatewayProcess
    extra: list = field(default_factory=list)  # processes a test started and the stack stops at the end
    module: str = ""  # the test module that used it last

    def fresh(self, module: str, timeout: float = 90.0) -> Stack:
        """The stack as ``module`` finds it, whatever ran before: every namespace but the worker's emptied (what a
        module queued where no worker reads stays queued, and a later module's requests met the 30-request cap
        there: 429 where 202 was asked), the worker's own drained, no call in flight at either gateway. Once per
        module (again if another module ran in between)."""
        if module == self.module:
            return self
        server = redis.Redis.from_url(self.server.url)
        for key in server.scan_iter(count=1000):  # globex, kill, and those of a module's own gateways
            if not key.startswith(b"dq:") or b":call:" in key:  # System One's call mappings too
                server.delete(key)
        dq = [stream for lane in LANES for stream in (Keys("dq").requests_in(lane), Keys("dq").parts_in(lane))]
        deadline = time.monotonic() + timeout
        while sum(server.xlen(stream) for stream in dq) or self._in_flight():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the gateway stack did not drain before {module}")
            time.sleep(0.1)
        server.close()
        self.module = module
        return self

    def _in_flight(self) -> float:
        """Calls being answered at either gateway, the /metrics call that asks aside."""
        return sum(g.metric("dq_gateway_in_flight") - g.metric("dq_gateway_in_flight", route="metrics")
                   for g in (self.gateway, self.open))

    def stop(self) -> None:
        for process in [self.gateway, self.open, self.worker, *self.extra]:
            process.stop()
        self.server.__exit__()


def start_stack(tiny_dir: Path, where: Path, worker_class: type) -> Stack:
    server = RedisServer().start()
    worker = worker_class(tiny_dir, server.url, where / "worker.log")
    gateway = GatewayProcess(server.url, where / "gateway.log", KEYS, **LIMITS)
    opened = GatewayProcess(server.url, where / "open.log")
    stack = Stack(server, worker, gateway, opened)
    try:
        gateway.wait_up(), opened.wait_up(), worker.wait_ready()
    except Exception:
        stack.stop()
        raise
    return stack
