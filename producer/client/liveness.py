"""Whether anyone will answer: a wait (``Producer.wait_many``) during which no worker of the namespace is
alive (none started, all gone, a mistyped namespace) ends after ``no_worker_s``, not after its whole timeout,
saying so.

Liveness is a heartbeat younger than ``GONE_S`` (producer/wire/keys.py). It is looked at a second into a wait
that has not got its results, then every ``LOOK_S``: a wait answered at once pays nothing for it. Once a
worker is seen alive (or this user may not read the heartbeats), a wait runs its whole timeout.
"""

from __future__ import annotations

import time

from ..wire.keys import GONE_S

NO_WORKER_S, LOOK_S = 15.0, 5.0


class Liveness:
    """One wait's looks at the workers' heartbeats."""

    def __init__(self, namespace: str, no_worker_s: float | None, forever: bool) -> None:
        self.namespace, self.no_worker_s = namespace, no_worker_s
        self.started = time.monotonic()
        self.seen = no_worker_s is None or forever  # a worker seen alive, or nothing to watch for
        self.next_look = self.started + min(1.0, no_worker_s or 0.0)

    def due(self, late: bool) -> bool:
        """Whether to look now (at the deadline, always, so that a timeout can say why)."""
        return not self.seen and (late or time.monotonic() >= self.next_look)

    def looked(self, live: int | None) -> None:
        """What a look found: how many live workers (None: this user may not read the heartbeats)."""
        self.seen, self.next_look = live != 0, time.monotonic() + LOOK_S

    def gone(self, late: bool) -> bool:
        """No worker alive for the whole wait, and the wait is over (late) or has gone ``no_worker_s``."""
        return not self.seen and (late or time.monotonic() - self.started >= self.no_worker_s)  # type: ignore

    def why(self) -> str:
        return (f"; no live worker in namespace {self.namespace!r} (no heartbeat in the last {GONE_S} s: "
                "none started, or the namespace is wrong): they stay queued until one starts")
