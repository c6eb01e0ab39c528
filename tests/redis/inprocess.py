"""A worker in the test's own process: the real Daemon (readers, lifecycle, planner threads, compute) in threads,
on a tiny model loaded once per session, against a real server. No mock of Redis or of the model; only the process
is the test's, so a test pays no interpreter start, no transformers import and no model load.

    worker = InProcessWorker(model, server.url).start()       # serves until stop(), like a worker process
    InProcessWorker(model, server.url).burst()                # returns once its streams are drained

Subprocess workers (conftest.WorkerProcess) stay for what needs a process of its own: signals, kill -9, exit
codes, TLS, Prometheus scraping and the CLI.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

from faulty_worker import FaultyEngine
from producer.local.ports import free_port
from support import http_get
from worker.config import Settings
from worker.daemon import Daemon
from worker.health import serve_http, status

NUMBERS = itertools.count()
# Short waits: a burst run ends one read after the streams empty; a stop drains within seconds.
QUICK = dict(block_ms=100, drain_timeout_s=10.0, planner_processes=0, device="cpu", engine="reference")


class InProcessWorker:
    def __init__(self, model: Any, redis_url: str, raise_on: str = "", slow_s: float = 0.0, http: bool = False,
                 **settings: Any) -> None:
        # Each its own consumer of the group, as each worker process is.
        settings.setdefault("consumer", f"in-process-{next(NUMBERS)}")
        self.settings = Settings.from_env({}, redis_url=redis_url, **{**QUICK, **settings})
        self.daemon = Daemon(self.settings, model=model)
        # A poison input, or slow packs: the same injector the fault tests' processes use (its counters: ``faults``).
        self.faults = FaultyEngine(self.daemon.compute.engine, model.tokenizer, raise_on, slow_s)
        self.daemon.compute.engine = self.faults
        self.http = serve_http(self.daemon, free_port(), "127.0.0.1") if http else None  # /healthz, /readyz
        self.exit_code: int | None = None
        self.daemon.exit = self._exit
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _exit(self, code: int) -> None:
        """Where a worker process would end with ``code`` at once: recorded, and the worker stopped (it drains
        what it can within its short drain deadline)."""
        self.exit_code = code
        self.daemon.stop()

    def _run(self, burst: bool) -> None:
        try:
            self.daemon.run(burst=burst)
        except BaseException as error:  # noqa: BLE001 - reported by join()
            self.error = error

    def start(self, burst: bool = False, ready: bool = True) -> InProcessWorker:
        self.thread = threading.Thread(target=self._run, args=(burst,), name="in-process-worker", daemon=True)
        self.thread.start()
        if ready:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 60.0) -> InProcessWorker:
        deadline = time.monotonic() + timeout
        while not status(self.daemon.snapshot())["ready"]:  # what /readyz answers
            if time.monotonic() > deadline:
                raise TimeoutError("the in-process worker is not ready")
            time.sleep(0.02)
        return self

    def burst(self, timeout: float = 120.0) -> InProcessWorker:
        """Serve until every stream it reads is drained and nothing is held, then stop."""
        self.start(burst=True, ready=False)
        return self.join(timeout)

    def stop(self, timeout: float = 30.0) -> InProcessWorker:
        self.daemon.stop()
        return self.join(timeout)

    @property
    def port(self) -> int:  # its health server's
        assert self.http is not None, "start it with http=True"
        return self.http.server_port

    @property
    def alive(self) -> bool:
        """Serving, and no fatal error (where a process would have exited)."""
        return self.exit_code is None and self.thread is not None and self.thread.is_alive()

    def get(self, path: str) -> tuple[int, str]:
        """GET a path of its health server (``http=True``), as a probe would."""
        return http_get(f"http://127.0.0.1:{self.port}{path}")

    def join(self, timeout: float) -> InProcessWorker:
        assert self.thread is not None
        self.thread.join(timeout)
        if self.http is not None:
            self.http.shutdown()
            self.http.server_close()
            self.http = None
        if self.thread.is_alive():
            raise TimeoutError(f"the in-process worker did not stop within {timeout} s")
        if self.error is not None:
            raise self.error
        return self

    def metric(self, name: str, **labels: str) -> float:
        """The sum of a metric's samples with these labels, read from the worker's own registry."""
        return sum(sample.value for family in self.daemon.metrics.registry.collect() for sample in family.samples
                   if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))
