"""The pack policy: how large the next pack is, from what waits, how long the oldest high-priority request has
waited against its target, and what each size costs; and the clock the packer keeps it by.

A pack's size is one of the static sizes (the CUDA graph buckets; an eager engine's packs are sized as if it
had powers of two). The pack that would start on the GPU at ``start`` is:

- the smallest size that holds everything queued: a request waits for the GPU, never for company, and a
  backlog makes full packs of the largest size back to back (the throughput);
- or the size below it, when a pack of that size and then one of the rest would end sooner than the larger one
  (what is queued is just over a size: the padding would cost more than a second, smaller pack);
- while high-priority work waits, no larger than the largest size whose run ends within the high lane's target
  for the oldest high request (``high_target``, counted from when it was taken), or, when none would, the
  smallest that holds the high work: a high request waits for the pack on the GPU and then its own, which is
  sized for it.

The normal lane has no target of its own here. Shrinking packs for its oldest request (tried:
docs/BENCHMARKS.md, "The pack policy") made the queue behind it grow in bursts, and the next pack larger
still; packs that take everything, launched just in time behind the running one (worker/gpu/packer.py), grow
and shrink with the load.

What each size costs is learned from the packs run (``Costs``: the median device time of each's last runs).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass

from producer.wire.keys import HIGH, Priority

# The 2B shape in bf16 on an H100 (docs/BENCHMARKS.md): a 512-token pack 6.3 ms, 4096 about 25, 16384 84.
# Only until a size has been run: then its own measured time counts.
PRIOR_FIXED_S, PRIOR_PER_TOKEN_S = 0.0038, 4.9e-6
RUNS = 9  # a size's cost is the median of its last runs
SMALLEST = 512  # an eager engine's packs are sized in powers of two from here
FULL = 0.9  # a pack this full of its size wastes little on padding


class Clock:
    """Real time: ``now`` is monotonic seconds, ``wait`` blocks on the packer's condition (the simulation,
    ops/bench/simulate.py, passes a virtual one)."""

    def now(self) -> float:
        return time.monotonic()

    def wait(self, condition: threading.Condition, timeout: float) -> None:
        """Until ``condition`` is notified or ``timeout`` seconds pass (its lock held)."""
        condition.wait(timeout)


class Costs:
    """The seconds a pack of each size runs on the device, learned from the packs run (the median of each size's
    last ``RUNS``: a pack stretched by a pause of the host moves it little); a size not run yet is estimated
    from the sizes run (a fixed cost and a cost per token), else the prior."""

    def __init__(self) -> None:
        self.runs: dict[int, deque[float]] = {}
        self.seen: dict[int, float] = {}  # each size's median

    def observe(self, size: int, seconds: float) -> None:
        runs = self.runs.setdefault(size, deque(maxlen=RUNS))
        runs.append(seconds)
        self.seen[size] = statistics.median(runs)

    def seconds(self, size: int) -> float:
        if size in self.seen:
            return self.seen[size]
        if not self.seen:
            return PRIOR_FIXED_S + PRIOR_PER_TOKEN_S * size
        below = [each for each in self.seen if each < size]
        above = [each for each in self.seen if each > size]
        if below and above:  # between two sizes run: on the line through them
            low, high = max(below), min(above)
        elif len(self.seen) > 1:  # beyond them: on the line through the two nearest
            low, high = sorted(self.seen, key=lambda each: abs(each - size))[:2]
            low, high = min(low, high), max(low, high)
        else:  # one size run: the prior's shape, scaled to it
            [known] = self.seen
            return self.seen[known] * (PRIOR_FIXED_S + PRIOR_PER_TOKEN_S * size) / (
                PRIOR_FIXED_S + PRIOR_PER_TOKEN_S * known)
        slope = (self.seen[high] - self.seen[low]) / (high - low)
        return max(1e-4, self.seen[low] + slope * (size - low))


@dataclass(frozen=True)
class Waiting:
    """What the policy reads of the queue: tokens queued (all lanes, and the high lane's), and since when the
    oldest prompt of each lane has waited (the clock's time it was taken; None: none waits)."""

    tokens: int
    high_tokens: int
    oldest: dict[Priority, float | None]


class Policy:
    """The size of the next pack (``size``), from the static sizes, the high target and what each costs."""

    def __init__(self, budget: int, sizes: tuple[int, ...], high_target: float) -> None:
        """``sizes``: the engine's static sizes (none: powers of two up to ``budget``, and ``budget``);
        ``high_target``: seconds a high-priority request should take from taken to read out."""
        if not sizes:
            powers = {SMALLEST << shift for shift in range(32) if SMALLEST << shift < budget}
            sizes = tuple(sorted(powers | {budget}))
        self.sizes = tuple(sorted(sizes))
        self.high_target = high_target
        self.costs = Costs()
        self.launch_seconds = 0.002  # host time of a launch (layout, copies, kernels enqueued), learned

    def holding(self, tokens: int) -> int:
        """The smallest size that holds ``tokens``, else the largest."""
        return next((size for size in self.sizes if size >= tokens), self.sizes[-1])

    def size(self, waiting: Waiting, start: float) -> int:
        """The size of a pack that starts on the GPU at ``start`` (clock seconds)."""
        size = self.fitted(waiting.tokens)
        if waiting.oldest[HIGH] is not None:
            high = self._meeting(waiting.oldest[HIGH], start)
            size = min(size, high if high is not None else self.holding(waiting.high_tokens))
        return size

    def fitted(self, tokens: int) -> int:
        """The size for ``tokens`` queued: the smallest that holds them, unless the size below it and then a
        pack of the rest would end sooner (``tokens`` just over a size: the padding of the larger one costs
        more than running the rest after)."""
        holding = self.holding(tokens)
        below = [size for size in self.sizes if size < holding]
        if not below or tokens >= FULL * holding:
            return holding
        seconds = self.costs.seconds
        split = seconds(below[-1]) + seconds(self.holding(tokens - below[-1]))
        return below[-1] if split < seconds(holding) else holding

    def launched(self, seconds: float) -> None:
        """A launch took ``seconds`` of host time: a moving mean of them."""
        self.launch_seconds += 0.2 * (seconds - self.launch_seconds)

    def lead(self, running: int) -> float:
        """How long before a running pack of size ``running`` ends the next one is launched: just in time, its
        launch's host time and a margin for the estimate of the running pack's end. (Room for the launch's spread
        as well, twice its mean deviation, cost the normal lane a point in the simulation with a pausing host
        and bought the high lane nothing.)"""
        return self.launch_seconds + max(0.002, 0.05 * self.costs.seconds(running))

    def ahead(self, size: int) -> float:
        """How long before a running pack ends a full pack of ``size`` may be launched: for the largest size, as
        early as a high request arriving just after it would still meet its target behind it in a pack of the
        smallest size (nothing arriving later could join a full pack anyway, and the GPU stays fed through the
        host's longer pauses at the peak); for the others 0, just in time (later work rides in them)."""
        if size != self.sizes[-1]:
            return 0.0
        return max(0.0, self.high_target - self.costs.seconds(size) - self.costs.seconds(self.sizes[0]))

    def _meeting(self, since: float, start: float) -> int | None:
        """The largest size whose run, starting at ``start``, ends within the high lane's target for a prompt
        waiting ``since``; None when even the smallest would end late."""
        left = self.high_target - (start - since)
        return max((size for size in self.sizes if self.costs.seconds(size) <= left), default=None)
