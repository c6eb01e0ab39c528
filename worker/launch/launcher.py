"""One host, many GPUs: ``dq-worker serve --gpus all`` (or ``0,1,3``, or ``cpu:N``) starts one worker process
per device and supervises them (docs/OPERATIONS.md, "One host, many GPUs").

- Worker ``i`` is ``python -m worker serve`` with the launcher's settings (passed as DQ_* variables), pinned
  to its device (``CUDA_VISIBLE_DEVICES`` = that GPU and ``--device cuda:0``; ``cpu:N``: ``--device cpu``, no
  GPU visible), its own consumer name (``<--consumer, or host-pid of the launcher>-<i>``: the same after a
  restart, so a restarted worker recovers its own pending entries at once), metrics port ``--metrics-port + 1
  + i`` (the launcher's own endpoints on ``--metrics-port``), and planner processes sized to the host's cores
  (``planner_processes``).
- A worker that exits on its own is started again after a pause that doubles with each exit in a row (1 s to
  60 s), the row reset once it is ready (up 60 s where it has no endpoints); each exit is logged once and
  counted (``dq_launcher_restarts_total``). Exit 2 is not retried: its settings, checkpoint or engine would
  fail the same way in every worker, so the launcher stops the others and exits 2.
- SIGTERM or SIGINT is forwarded to every worker, and each drains (``--drain-timeout-s``); one still running
  ``KILL_AFTER_S`` later is killed. The launcher exits 0 when every worker stopped by itself and no consumer
  of this host holds a pending entry (read from Redis): all drained; else 1. A second signal is forwarded too:
  the workers exit at once.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                               disable_created_metrics, generate_latest)

from producer.plumbing.endpoints import NOT_FOUND, Answer, serve_paths
from producer.wire.keys import LANES, Keys, text

from ..config import Settings
from .host import Device, LaunchError, devices, environment, host_cores

log = logging.getLogger("worker.launcher")
disable_created_metrics()  # as worker/metrics.py: no _created series

# what a worker runs (then "serve"); tests/redis/faulty_worker.py points it at itself
ENTRY = ["-m", "worker"]
# restart pauses; up this long (no endpoints) resets the row
BACKOFF_S, BACKOFF_MAX_S, STABLE_S = 1.0, 60.0, 60.0
KILL_AFTER_S = 30.0  # past --drain-timeout-s, a worker still running is killed
STALE_S = 30.0  # the supervision loop not turning for this long: not live


@dataclass
class Worker:
    """One supervised worker process: where it runs, its consumer name and port, its restarts."""

    where: Device
    consumer: str
    port: int  # 0: no endpoints
    process: subprocess.Popen | None = None
    started: float = 0.0  # monotonic
    in_a_row: int = 0  # exits since it was last ready (no endpoints: up STABLE_S)
    restart_at: float = 0.0  # monotonic: when a stopped worker starts again
    ready: bool = False


class Launcher:
    """serve --gpus: one worker process per device, started, watched and restarted."""

    def __init__(self, settings: Settings, where: list[Device], command: list[str] | None = None,
                 environ: dict[str, str] | None = None, cores: int | None = None) -> None:
        self.settings = settings
        self.command = command or [sys.executable, *ENTRY, "serve"]
        self.environ = dict(os.environ if environ is None else environ)
        self.cores = cores or host_cores()
        base = settings.consumer or f"{socket.gethostname()}-{os.getpid()}"
        port = settings.metrics_port
        if port and port + len(where) > 65535:
            raise LaunchError(f"--metrics-port {port}: its workers' ports {port + 1}-{port + len(where)} "
                              "pass 65535")
        self.workers = [Worker(d, f"{base}-{d.index}", port + 1 + d.index if port else 0) for d in where]
        self.stopping = threading.Event()
        self.signals = 0
        self.turned_at = time.time()
        self.registry = CollectorRegistry()
        self.restarts = Counter("dq_launcher_restarts_total",
                                "Workers started again after exiting on their own", ["worker"],
                                registry=self.registry)
        self.in_a_row = Gauge("dq_launcher_exits_in_a_row", "Exits of a worker since it was last ready (with "
                              "no endpoints: up 60 s): 3 or more is a crash loop", ["worker"],
                              registry=self.registry)
        self.up = Gauge("dq_launcher_worker_ready", "1 while the worker answers /readyz with 200", ["worker"],
                        registry=self.registry)
        for w in self.workers:
            for metric in (self.restarts, self.in_a_row, self.up):
                metric.labels(str(w.where.index))

    # ---------------------------------------------------------------- the workers

    def _start(self, w: Worker) -> None:
        # A process group of its own: a terminal's ^C reaches the launcher only, which forwards one signal (a
        # worker signalled twice exits without draining); a launcher that dies takes its workers down with it.
        env = environment(self.settings, w.where, w.consumer, w.port, len(self.workers), self.cores,
                          self.environ)
        w.process = subprocess.Popen(self.command, env=env, process_group=0, preexec_fn=_die_with_parent)
        w.started, w.ready = time.monotonic(), False
        log.info("worker %d started: pid %d, device %s%s, consumer %s%s", w.where.index, w.process.pid,
                 w.where.device, f" (GPU {w.where.visible})" if w.where.visible else "", w.consumer,
                 f", port {w.port}" if w.port else "")

    def _exited(self, w: Worker, code: int) -> None:
        now = time.monotonic()
        if not w.port and now - w.started >= STABLE_S:  # with endpoints, the probe resets the row once ready
            w.in_a_row = 0
        w.in_a_row += 1
        pause = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (w.in_a_row - 1))
        w.process, w.ready, w.restart_at = None, False, now + pause
        index = str(w.where.index)
        self.in_a_row.labels(index).set(w.in_a_row)
        self.up.labels(index).set(0)
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited {code}"
        log.error("worker %d %s (%d in a row): starting it again in %.0f s", w.where.index, how,
                  w.in_a_row, pause)

    # ---------------------------------------------------------------- supervision (main thread)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)
        for w in self.workers:
            self._start(w)
        if any(w.port for w in self.workers):
            threading.Thread(target=self._probe, name="probe", daemon=True).start()
        fatal = 0
        while not self.stopping.is_set() and not fatal:
            self.turned_at = time.time()
            for w in self.workers:
                code = w.process.poll() if w.process else None
                if code == 2:
                    log.error("worker %d refused to start (exit 2): every worker would; stopping them all",
                              w.where.index)
                    fatal, w.process = 2, None
                elif code is not None:
                    self._exited(w, code)
                if w.process is None and not fatal and time.monotonic() >= w.restart_at:
                    self.restarts.labels(str(w.where.index)).inc()
                    self._start(w)
            time.sleep(0.1)
        return self._stop_all(fatal)

    def on_signal(self, signum: int, _frame: Any = None) -> None:
        self.signals += 1
        if self.signals == 1:
            log.info("%s: draining %d workers", signal.Signals(signum).name, len(self.workers))
        else:
            log.warning("second signal: the workers exit without draining")
            self._signal_all(signal.SIGTERM)
        self.stopping.set()

    def _signal_all(self, sig: int) -> None:
        for w in self.workers:
            if w.process is not None and w.process.poll() is None:
                w.process.send_signal(sig)

    def _stop_all(self, fatal: int) -> int:
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.settings.drain_timeout_s + KILL_AFTER_S
        killed = False
        for w in self.workers:
            if w.process is None:
                continue
            try:
                code = w.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker %d still running %.0f s past its drain: killed", w.where.index,
                          KILL_AFTER_S)
                w.process.kill()
                code, killed = w.process.wait(), True
            if code:
                log.warning("worker %d stopped with exit code %d", w.where.index, code)
        if fatal:  # each stopped worker's last line says what it left
            return fatal
        # what the workers' exit codes cannot say: whether all they took was answered
        pending = self.pending()
        if pending:
            log.warning("stopped: %d entries left pending for this host's consumers; other workers reclaim "
                        "them after %d ms", pending, self.settings.claim_idle_ms)
        elif pending == 0:
            log.info("stopped: every worker drained, nothing left pending")
        return 0 if pending == 0 and not killed else 1

    def pending(self) -> int | None:
        """Entries pending for this host's consumers on the shard's work streams; None when Redis cannot
        say."""
        import redis

        from producer.plumbing.connection import connect

        names, keys, total = {w.consumer for w in self.workers}, Keys(self.settings.namespace,
                                                                      self.settings.shard), 0
        try:
            client = connect(self.settings.redis_url, self.settings.redis_cluster,
                             **self.settings.redis_options())
            try:
                for stream in [s for lane in LANES for s in (keys.requests_in(lane), keys.parts_in(lane))]:
                    try:
                        summary = client.xpending(stream, keys.group)
                    except redis.ResponseError as error:  # no stream or group: nothing was ever taken there
                        if "NOGROUP" not in str(error):
                            raise
                        continue
                    total += sum(int(c["pending"]) for c in summary["consumers"] or []
                                 if text(c["name"]) in names)
                return total
            finally:
                client.close()
        except Exception as error:  # noqa: BLE001 - any failure means: unknown (said, and exit 1)
            log.warning("stopped; could not read from Redis whether this host's consumers left entries "
                        "pending: %s",
                        error)
            return None

    # ---------------------------------------------------------------- health

    def _probe(self) -> None:
        """Each worker's /readyz, every second: the launcher's readiness and the reset of a worker's exits.
        Only the answer of the process it started counts (``pid``): restarted right after its own kill -9, a
        launcher found its orphaned workers still draining on the ports and reported ready before its own had
        loaded."""
        host = self.settings.metrics_host
        host = "127.0.0.1" if host in ("", "::", "0.0.0.0") else f"[{host}]" if ":" in host else host
        while not self.stopping.is_set():
            for w in self.workers:
                process = w.process
                ready = False
                if process is not None and process.poll() is None and w.port:
                    # its own child's answer only: a worker of an earlier launcher may still hold the port
                    try:
                        with urllib.request.urlopen(f"http://{host}:{w.port}/readyz", timeout=1.0) as reply:
                            ready = reply.status == 200 and json.loads(reply.read()).get("pid") == process.pid
                    except (OSError, ValueError, AttributeError):
                        pass
                if w.process is process:  # not restarted meanwhile
                    w.ready = ready
                    if ready and w.in_a_row:
                        w.in_a_row = 0
                        self.in_a_row.labels(str(w.where.index)).set(0)
                    self.up.labels(str(w.where.index)).set(1 if ready else 0)
            time.sleep(1.0)

    def status(self) -> dict[str, Any]:
        """Live: the supervision loop turns. Ready: every worker ready (a crash-looping one keeps the host
        unready, never unlive: restarting the launcher would stop the good workers too)."""
        now = time.monotonic()
        workers = [{"worker": w.where.index, "device": w.where.device, "gpu": w.where.visible or None,
                    "consumer": w.consumer, "port": w.port or None,
                    "pid": w.process.pid if w.process else None, "ready": w.ready, "exits_in_a_row": w.in_a_row,
                    "starts_in_s": round(max(0.0, w.restart_at - now), 1) if w.process is None else None}
                   for w in self.workers]
        live = self.stopping.is_set() or time.time() - self.turned_at < STALE_S  # a drain is no hang
        ready = live and not self.stopping.is_set() and all(w.ready for w in self.workers)
        return {"live": live, "ready": ready, "stopping": self.stopping.is_set(), "workers": workers}

    def serve_http(self, port: int, host: str = "") -> None:
        launcher = self

        def answer(path: str) -> Answer:
            if path == "/metrics":
                return 200, generate_latest(launcher.registry), CONTENT_TYPE_LATEST
            if path not in ("/healthz", "/health", "/readyz"):
                return NOT_FOUND
            state = launcher.status()
            code = 200 if state["ready" if path == "/readyz" else "live"] else 503
            return code, json.dumps(state).encode(), "application/json"

        serve_paths(host, port, answer)
        log.info("launcher: /metrics, /healthz and /readyz on port %d; worker i on port %d + 1 + i", port, port)


_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _die_with_parent() -> None:
    """In the worker, before it runs: SIGTERM when the launcher dies (kill -9 included), so that no worker is
    left holding its GPU (PR_SET_PDEATHSIG; Linux only). It comes again as the worker is handed on from each
    dying thread of the launcher, so the worker exits without draining: a crash, what it held reclaimed after
    --claim-idle-ms."""
    if _prctl is not None:
        _prctl(1, signal.SIGTERM, 0, 0, 0)


def serve(settings: Settings, command: list[str] | None = None) -> int:
    """``dq-worker serve --gpus ...``: 2 when the host cannot give what --gpus asks, else the launcher's
    code."""
    from ..logs import setup_logging

    setup_logging(settings.log_format, settings.log_level)
    try:
        launcher = Launcher(settings, devices(settings.gpus), command)
        if settings.metrics_port:
            launcher.serve_http(settings.metrics_port, settings.metrics_host)
    except (LaunchError, OSError) as error:
        log.error("cannot start: %s", error)
        return 2
    log.info("launching %d workers (%s), %d cores", len(launcher.workers), settings.gpus, launcher.cores)
    return launcher.run()
