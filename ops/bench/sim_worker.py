"""A worker on a virtual clock, for ops/bench/simulate.py: the real packer and GPU loop (worker/gpu/packer.py,
compute.py, or those of an earlier commit), fed by a modelled host (the stream read, the planners, the look-up, the
settle) and a modelled GPU (each static size's run time, the launch's host time, the read-out).

One thread. Whenever the code under test waits (the packer for work or for its launch moment, the GPU thread for a
pack), the clock jumps to the next event (an arrival, a planner finishing, a pack ending), runs it, and hands back.
What it cannot see: anything that stops the host (the collector's passes, the GIL held by another thread, a slow
Redis call); every host step takes its modelled time, always.
"""

from __future__ import annotations

import functools
import heapq
import importlib.util
import math
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from producer.wire.keys import HIGH, NORMAL  # noqa: E402
from worker.metrics import Metrics  # noqa: E402
from worker.model.engine import PackRun, Pending  # noqa: E402
from worker.tasks import Computed, Item  # noqa: E402

MS = 1e-3


@dataclass
class Costs:
    """The modelled worker, in seconds. Defaults: the 2B shape in bf16 on one H100 (docs/BENCHMARKS.md): a pack
    runs ``fixed + per_token x size`` on the GPU (512 tokens 6.3 ms, 4096 about 24, 16384 84.1); a lone request's
    planning 3.9 ms and computing 7.7 ms, of which 6.3 on the GPU (acbedcd)."""

    fixed: float = 3.8 * MS
    per_token: float = 4.9e-3 * MS
    launch: float = 4.5 * MS  # the GPU thread's host time in a launch (the GPU waits for it on a small pack)
    launch_spread: float = 0.0  # each launch's host time times e^N(0, this): a host that pauses (the GIL, ...)
    prelude: float = 0.5 * MS  # launch to the pack's first kernel (layout, the copy in)
    read_out: float = 0.4 * MS  # a pack's scores waited for and copied out
    read_out_prompt: float = 0.05 * MS  # each prompt's answers
    read: float = 0.3 * MS  # enqueue to taken, when the worker has room
    read_count: int = 128  # entries per read (--read-count of the benchmarks' worker)
    max_inflight: int = 1024  # held entries per lane
    plan_alone: float = 3.9 * MS  # taken to queued for an entry alone in the worker (planned in its thread)
    plan_hop: float = 4.0 * MS  # the hop to a planner process and back, and the look-up (not a planner's time)
    plan_service: float = 1.4 * MS  # one planner process's work on an entry
    planners: int = 4
    settle: float = 0.9 * MS  # answers read out to the result published
    enqueue: float = 0.7 * MS  # the client's submit call (a lone caller's view only)
    wake: float = 0.3 * MS  # the result published to the client's wait returning (a lone caller's view only)

    def gpu(self, size: int) -> float:
        return self.fixed + self.per_token * size


@dataclass(eq=False)
class Request:
    """One request of one prompt, and when it passed each step (clock seconds)."""

    tokens: int
    lane: str = NORMAL
    enqueued: float = 0.0
    taken: float = 0.0
    queued: float = 0.0
    done: float = 0.0
    # what the packer and the GPU loop read of a task
    closed: bool = False
    expired: bool = False
    delivery: SimpleNamespace = field(default_factory=SimpleNamespace)

    def __post_init__(self) -> None:
        self.delivery = SimpleNamespace(lane=self.lane)
        self.prompts = [SimpleNamespace(length=self.tokens, room=self.tokens, questions=())]


class Sim:
    """The event queue, the clock, and the modelled host around the packer."""

    def __init__(self, costs: Costs) -> None:
        self.costs, self.t, self.events, self.seq = costs, 1000.0, [], 0
        self.packer = None  # set by the harness
        self.stream = {NORMAL: [], HIGH: []}  # enqueued, not taken
        self.held = {NORMAL: 0, HIGH: 0}
        self.reading = {NORMAL: False, HIGH: False}
        self.planners_free = [self.t] * costs.planners
        self.planning: list[tuple[int, float, Request]] = []  # waiting for a planner: (lane order, taken, request)
        self.busy_planners = 0
        self.done: list[Request] = []
        self.on_done: Callable[[Request], None] = lambda request: None

    # ---- the clock
    def at(self, when: float, action: Callable[[], None]) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, action))

    def run_until(self, until: float, one: bool = False) -> None:
        """Run the events up to ``until`` (only the first, with ``one``) and move the clock there."""
        while self.events and self.events[0][0] <= until:
            when, _, action = heapq.heappop(self.events)
            self.t = max(self.t, when)
            action()
            if one:
                return
        self.t = max(self.t, until)

    def idle(self) -> bool:
        return not self.events

    # ---- the host: stream, read, plan, look up, queue; settle
    def enqueue(self, request: Request) -> None:
        request.enqueued = self.t
        self.stream[request.lane].append(request)
        self._read(request.lane)

    def _read(self, lane: str) -> None:
        room = self.costs.max_inflight - self.held[lane]
        if self.reading[lane] or not self.stream[lane] or room <= 0:
            return
        self.reading[lane] = True
        self.at(self.t + self.costs.read, lambda: self._taken(lane))

    def _taken(self, lane: str) -> None:
        self.reading[lane] = False
        room = self.costs.max_inflight - self.held[lane]
        count = min(room, self.costs.read_count, len(self.stream[lane]))
        taken, self.stream[lane] = self.stream[lane][:count], self.stream[lane][count:]
        for request in taken:
            alone = sum(self.held.values()) == 0 and not self.busy_planners and not self.planning
            self.held[lane] += 1
            request.taken = self.t
            if alone:  # planned in the worker's own thread
                self.busy_planners += 1
                self.at(self.t + self.costs.plan_alone, lambda r=request: self._planned(r, alone=True))
            else:
                self.planning.append((0 if lane == HIGH else 1, self.t, request))
        self._plan()
        self._read(lane)

    def _plan(self) -> None:
        """Planner processes: high entries first, each in the first free one."""
        self.planning.sort(key=lambda job: job[:2])
        while self.planning and min(self.planners_free) <= self.t + 1e-12:
            _, _, request = self.planning.pop(0)
            index = self.planners_free.index(min(self.planners_free))
            self.planners_free[index] = self.t + self.costs.plan_service
            self.busy_planners += 1
            self.at(self.t + self.costs.plan_service + self.costs.plan_hop, lambda r=request: self._planned(r))
            self.at(self.planners_free[index], self._plan)

    def _planned(self, request: Request, alone: bool = False) -> None:
        self.busy_planners -= 1
        request.queued = self.t
        item = Item(request, 0, request.prompts[0])
        if "waited" in self.packer.put.__code__.co_varnames:
            self.packer.put([item], waited=self.t - request.taken)
        else:  # an earlier packer
            self.packer.put([item])
        self._plan()

    def computed(self, request: Request) -> None:
        self.at(self.t + self.costs.settle, lambda: self._settled(request))

    def _settled(self, request: Request) -> None:
        request.done = self.t
        self.held[request.lane] -= 1
        self.done.append(request)
        self.on_done(request)
        self._read(request.lane)


class VirtualClock:
    """The packer's clock (worker/gpu/policy.py's Clock) on the simulation's time."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim

    def now(self) -> float:
        return self.sim.t

    def wait(self, condition, timeout: float) -> None:
        self.sim.run_until(self.sim.t + max(0.0, timeout), one=True)


class VirtualCondition:
    """For a packer without a clock (an earlier commit's): its condition and ``time.monotonic`` on the
    simulation's time."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim

    def __enter__(self):
        return self

    def __exit__(self, *_) -> None:
        pass

    def notify(self) -> None:
        pass

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        deadline = self.sim.t + timeout
        while not predicate() and self.sim.t < deadline:
            self.sim.run_until(deadline, one=True)
        return predicate()

    def monotonic(self) -> float:
        return self.sim.t


class Engine:
    """The modelled GPU: a pack runs its static size's time once the GPU is free and its launch has begun, never
    ending before the launch's host work (small packs wait for the host)."""

    name = "simulated"
    deterministic = False

    def __init__(self, sim: Sim, budget: int, sizes: tuple[int, ...]) -> None:
        self.sim, self.max_pack_tokens, self.pack_sizes = sim, budget, sizes
        self.random = random.Random(7)
        self.free_at = sim.t  # the GPU's end of work
        self.busy = 0.0  # seconds the GPU ran packs

    def warmup(self) -> None:
        pass

    def launch(self, prompts) -> Pending:
        sim, costs = self.sim, self.sim.costs
        tokens = sum(prompt.length for prompt in prompts)
        size = next((each for each in self.pack_sizes if each >= tokens), tokens)
        began = sim.t
        host = costs.launch * math.exp(self.random.gauss(0.0, costs.launch_spread)) if costs.launch_spread \
            else costs.launch
        start = max(began + costs.prelude, self.free_at)
        end = max(start + costs.gpu(size), began + host)  # the GPU runs what the host has launched so far
        idle, self.free_at = max(0.0, start - self.free_at), end
        self.busy += end - start
        sim.run_until(began + host)  # the launch's host work: the other threads go on meanwhile

        def finish() -> PackRun:
            sim.run_until(end + costs.read_out)
            scores = [torch.zeros(0, 16) for _ in prompts]
            return PackRun(scores, tokens, size, size, True, sim.t - began, end - start, idle)

        return Pending(finish, finished=lambda: sim.t >= end)


class Sink:
    """The lifecycle's place: each computed prompt read out (its share of host time) and sent to settle."""

    def __init__(self, sim: Sim) -> None:
        self.sim = sim

    def hand_over(self, *events) -> None:  # one event each at commits before the read-out went in one call
        for event in events:
            if isinstance(event, Computed):
                self.sim.run_until(self.sim.t + self.sim.costs.read_out_prompt)
                self.sim.computed(event.item.task)


@functools.cache
def load_gpu_stage(commit: str | None) -> tuple[ModuleType, ModuleType]:
    """The packer and compute modules of the working tree, or of ``commit`` (read from git once per process,
    loaded beside worker.gpu as worker.gpu_<commit>)."""
    if commit is None:
        from worker.gpu import compute, packer

        return packer, compute
    name = f"worker.gpu_{commit}"
    folder = Path(tempfile.mkdtemp())
    for module in ("__init__", "policy", "packer", "compute"):  # policy.py: since the pack policy's own module
        source = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:worker/gpu/{module}.py"],
                                capture_output=True, text=True)
        if source.returncode == 0:
            (folder / f"{module}.py").write_text(source.stdout)
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py", submodule_search_locations=[
        str(folder)])
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    spec.loader.exec_module(package)
    loaded = []
    for module in ("packer", "compute"):
        spec = importlib.util.spec_from_file_location(f"{name}.{module}", folder / f"{module}.py")
        found = importlib.util.module_from_spec(spec)
        sys.modules[f"{name}.{module}"] = found
        spec.loader.exec_module(found)
        loaded.append(found)
    return loaded[0], loaded[1]


@dataclass
class Worker:
    """A fresh simulated worker: the packer and GPU loop of ``commit`` (None: this tree) with the worker's
    defaults, around ``Sim``."""

    costs: Costs = field(default_factory=Costs)
    commit: str | None = None
    sizes: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
    settings: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from worker.config import Settings

        self.sim = Sim(self.costs)
        packers, computes = load_gpu_stage(self.commit)
        budget = self.sizes[-1]
        if "clock" in packers.Packer.__init__.__code__.co_varnames:  # a packer with a clock (this tree's, b392b26's)
            defaults = Settings(**self.settings)
            self.packer = packers.Packer(budget, defaults.max_wait_ms / 1000, defaults.normal_share, self.sizes,
                                         defaults.high_target_ms / 1000, clock=VirtualClock(self.sim))
        else:  # an earlier packer: its own defaults (high_pack_tokens 4096 since it was a flag), its time virtual
            self.packer = packers.Packer(budget, 0.0, 0.1, self.settings.get("high_pack_tokens", 4096), self.sizes)
            condition = VirtualCondition(self.sim)
            self.packer.ready = condition
            packers.time = condition  # its time.monotonic()
        self.sim.packer = self.packer
        self.engine = Engine(self.sim, budget, self.sizes)
        model = SimpleNamespace(device=torch.device("cpu"), decision_config=None, offsets={})
        self.compute = computes.Compute(model, self.engine, self.packer, Metrics(), Sink(self.sim))

    def run(self, finished: Callable[[], bool]) -> None:
        """The GPU loop until ``finished()`` and nothing is left anywhere."""
        sim = self.sim

        def done() -> bool:
            return finished() and sim.idle() and not any(self.packer.lanes.values())

        self.compute.run(done)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan
