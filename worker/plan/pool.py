"""The planners' queue: jobs handed to a pool of planner threads or processes high lane first, with normal work
kept to its share of the starts, and a process pool that a dead planner broke replaced, its jobs run again one at a
time so that only the one that kills a planner alone fails."""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from concurrent.futures import BrokenExecutor, Executor, Future
from typing import Any, Callable

from producer.wire.keys import HIGH, LANES, NORMAL, Priority


class PlannerCrashed(RuntimeError):
    """Planning this entry alone killed a planner process: the entry is the cause (retried, then dead-lettered)."""


@dataclasses.dataclass
class _Waiting:
    out: Future
    work: Callable[..., Any]
    args: tuple
    lane: Priority


class LaneQueue:
    """Jobs handed to a pool high lane first, at most ``depth`` in the pool at once: the pool's own queue is FIFO,
    so a high entry would otherwise wait for every normal entry submitted before it. While normal jobs wait, they
    get ``normal_share`` of the starts (as packs give normal work its share of tokens): a flood of high work that
    outruns the planners does not starve normal work here either.

    A process pool breaks for good when one of its processes dies (the OOM killer, a crash in a decoder), and fails
    every job in it. With ``renew`` the broken pool is replaced, and the jobs it held run again one at a time, alone
    in the pool: one that breaks it alone is its cause and fails with ``PlannerCrashed``; the others are planned as
    if nothing happened."""

    def __init__(self, pool: Executor, depth: int, normal_share: float,
                 renew: Callable[[Executor], Executor] | None = None) -> None:
        self.pool, self.depth, self.normal_share, self.renew = pool, depth, normal_share, renew
        self.lock = threading.Lock()
        self.waiting: dict[Priority, deque[_Waiting]] = {lane: deque() for lane in LANES}
        self.suspects: deque[_Waiting] = deque()  # in a pool when it broke: each runs again alone
        self.running = 0
        self.alone = False  # a suspect is running
        self.owed = 0.0  # starts normal jobs are owed

    def _lane(self) -> Priority | None:
        """The lane of the next start (under the lock)."""
        if not self.waiting[NORMAL]:
            self.owed = 0.0
            return HIGH if self.waiting[HIGH] else None
        self.owed += self.normal_share
        if self.waiting[HIGH] and self.owed < 1:
            return HIGH
        self.owed = max(0.0, self.owed - 1)
        return NORMAL

    def submit(self, lane: Priority, work: Callable[..., Any], *args: Any) -> Future:
        out: Future = Future()
        with self.lock:
            self.waiting[lane].append(_Waiting(out, work, args, lane))
        self._pump()
        return out

    def claim_idle(self) -> bool:
        """True when no job runs or waits: then one job run outside the pool counts as running until ``release``
        (so the next one goes to the pool)."""
        with self.lock:
            if self.running or self.alone or self.suspects or any(self.waiting.values()):
                return False
            self.running += 1
            return True

    def release(self) -> None:
        """The job ``claim_idle`` let run outside the pool ended."""
        with self.lock:
            self.running -= 1
        self._pump()

    def _next(self) -> tuple[_Waiting, bool] | None:
        """The next job to start and whether it runs alone, or None (under the lock)."""
        if self.alone or self.running >= self.depth:
            return None
        if self.suspects:  # alone: once the pool has emptied
            return (self.suspects.popleft(), True) if self.running == 0 else None
        if not any(self.waiting.values()):
            return None
        return self.waiting[self._lane()].popleft(), False

    def _pump(self) -> None:
        while True:
            with self.lock:
                chosen = self._next()
                if chosen is None:
                    return
                job, alone = chosen
                self.running += 1
                self.alone = alone
                pool = self.pool
            try:
                inner = pool.submit(job.work, *job.args)
            except RuntimeError as error:  # shut down, or broken by a job before this one: settled here, in the
                self._settle(job, pool, alone, error)  # loop (a callback of a done future would recurse, job by job)
                continue
            inner.add_done_callback(lambda finished, job=job, pool=pool, alone=alone:
                                    self._done(finished, job, pool, alone))

    def _done(self, finished: Future, job: _Waiting, pool: Executor, alone: bool) -> None:
        error = finished.exception() if not finished.cancelled() else RuntimeError("planning cancelled")
        self._settle(job, pool, alone, error, None if error is not None else finished.result())
        self._pump()

    def _settle(self, job: _Waiting, pool: Executor, alone: bool, error: BaseException | None,
                result: Any = None) -> None:
        """A job's end: its result or error handed over; one that a broken pool failed waits to run again alone."""
        broken = isinstance(error, BrokenExecutor) and self.renew is not None
        with self.lock:
            self.running -= 1
            self.alone = False
            if broken and pool is self.pool:
                self.pool = self.renew(pool)
            if broken and not alone:
                self.suspects.append(job)
        if broken and not alone:
            return
        if broken:
            error = PlannerCrashed(f"planning this entry alone killed a planner process ({error})")
        if error is not None:
            job.out.set_exception(error)
        else:
            job.out.set_result(result)
