"""The System One tests' stack (tests/redis/test_systemone.py): a real server; two CPU worker processes serving two
different tiny checkpoints under two names, each in its namespace (``alpha``: the repo checkpoint as ``decider-a``;
``beta``: the readout checkpoint as ``decider-b``, alias ``b-alias``); the keyed gateway (``--model-alias
jev-latest=decider-a``, the official clients' default model) and an open one. One stack per server binary, shared by
the module's tests, which keep to requests of their own.

Keys (tenant = the key's namespace): ``acme`` and ``globex`` (two tenants, both models), ``alpha-only`` (namespace
alpha: decider-a alone), ``high-only`` (the high lane only: a System One call goes to the normal lane), ``one-slot``
(one call in flight).
"""

from __future__ import annotations

import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from gateways import GatewayProcess

from producer.local.server import RedisServer

TOKENS = {name: f"test-token-{name}-0123456789abcdef" for name in ("acme", "globex", "alpha-only", "high-only",
                                                                  "one-slot")}
BOTH = ["alpha", "beta"]
KEYS = [{"name": "acme", "token": TOKENS["acme"], "namespace": "acme", "model_namespaces": BOTH},
        {"name": "globex", "token": TOKENS["globex"], "namespace": "globex", "model_namespaces": BOTH},
        {"name": "alpha-only", "token": TOKENS["alpha-only"], "namespace": "alpha"},
        {"name": "high-only", "token": TOKENS["high-only"], "namespace": "acme", "model_namespaces": BOTH,
         "lanes": ["high"]},
        {"name": "one-slot", "token": TOKENS["one-slot"], "namespace": "acme", "model_namespaces": BOTH,
         "max_inflight": 1}]
MAX_BODY = 65536  # small, so that 413 is cheap to reach
MODELS = {"decider-a": "alpha", "decider-b": "beta"}


@dataclass
class Stack:
    server: RedisServer
    workers: dict  # namespace -> WorkerProcess
    gateway: GatewayProcess  # keyed
    open: GatewayProcess  # no keys; waits OPEN_WAIT_S for a result
    checkpoints: dict = field(default_factory=dict)  # served name -> checkpoint directory

    def stop(self) -> None:
        for process in [self.gateway, self.open, *self.workers.values()]:
            process.stop()
        self.server.__exit__()

    @contextmanager
    def paused(self, namespace: str):
        """A worker stopped (SIGSTOP) for the block, then let go on (SIGCONT) whatever happens in it. Its heartbeat
        stops too: a pause stays well short of the 30 s after which routing would count it gone."""
        process = self.workers[namespace].process
        process.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            process.send_signal(signal.SIGCONT)


OPEN_WAIT_S = 4


def start(worker_class: type, checkpoints: dict, where: Path) -> Stack:
    server = RedisServer().start()
    names = {"alpha": ("decider-a", checkpoints["repo"]), "beta": ("decider-b,b-alias", checkpoints["readout"])}
    workers = {namespace: worker_class(checkpoint, server.url, where / f"worker-{namespace}.log", namespace=namespace,
                                       served_model_name=served)
               for namespace, (served, checkpoint) in names.items()}
    gateway = GatewayProcess(server.url, where / "gateway.log", KEYS, max_body_bytes=MAX_BODY, wait_s=20,
                             model_alias="jev-latest=decider-a")
    opened = GatewayProcess(server.url, where / "open.log", model_namespaces="alpha,beta", wait_s=OPEN_WAIT_S,
                            model_alias="jev-latest=decider-a")
    stack = Stack(server, workers, gateway, opened, {"decider-a": checkpoints["repo"],
                                                     "decider-b": checkpoints["readout"]})
    try:
        for process in (gateway, opened, *workers.values()):
            process.wait_up() if isinstance(process, GatewayProcess) else process.wait_ready()
    except Exception:
        stack.stop()
        raise
    return stack


def wait_for(condition, timeout: float = 60.0, what: str = "") -> None:
    """Until ``condition()`` holds (polled), or an AssertionError naming ``what``."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:g} s: {what}")
        time.sleep(0.05)
