"""A virtual clock for the GPU stage's tests (test_compute.py, test_packer.py): the packer's clock
(worker/gpu/policy.py's Clock) on a time that moves only while something is waited for."""

from __future__ import annotations

from collections.abc import Callable


class StepClock:
    """Time that moves only while the packer or a pack is waited for: to the end of the wait, or to the first thing
    scheduled before it (which runs then)."""

    def __init__(self) -> None:
        self.t, self.scheduled = 100.0, []

    def now(self) -> float:
        return self.t

    def at(self, when: float, action: Callable[[], None]) -> None:
        self.scheduled = sorted([*self.scheduled, (when, action)], key=lambda each: each[0])

    def until(self, when: float) -> None:
        """Run everything scheduled up to ``when``, then stand at ``when``."""
        while self.scheduled and self.scheduled[0][0] <= when:
            at, action = self.scheduled.pop(0)
            self.t = max(self.t, at)
            action()
        self.t = max(self.t, when)

    def wait(self, condition, timeout: float) -> None:
        """The packer's wait: to the first thing scheduled within ``timeout`` (run), else to the timeout's end."""
        if self.scheduled and self.scheduled[0][0] <= self.t + timeout:
            when, action = self.scheduled.pop(0)
            self.t = max(self.t, when)
            action()
        else:
            self.t += timeout
