"""The GPU stage's order of work: the next pack is launched before the previous one is read out (the GPU never waits
for the host): a full one at once, a partly full one just before the previous one ends, with what arrived by then;
after the read-out when the previous one is done already (a synchronous engine: its answers do not wait for the
next launch's host work)."""

import json

import torch

from producer.wire.schema import Request
from step_clock import StepClock
from worker.entries import REQUESTS, Delivery
from worker.gpu.compute import Compute
from worker.gpu.packer import Packer
from worker.metrics import Metrics
from worker.model.encoder import Encoder
from worker.model.engine import Prompt, PackRun, Pending
from worker.tasks import Computed, Failed, Item, Launched, Task

BUDGET = 100


class RecordingEngine:
    """Launches nothing: records when each pack is launched and when its scores are waited for. Synchronous: each
    pack is done when its launch returns; else, with a clock, each runs ``seconds`` from its launch."""

    name = "recording"
    deterministic = False
    max_pack_tokens = BUDGET
    pack_sizes = ()

    def __init__(self, verbalizers: int, synchronous: bool = False, clock: StepClock | None = None,
                 seconds: float = 0.05) -> None:
        self.events: list[tuple[str, int]] = []
        self.verbalizers = verbalizers
        self.synchronous, self.clock, self.seconds = synchronous, clock, seconds
        self.free = 0.0  # when the packs launched so far will have run

    def warmup(self) -> None:
        pass

    def launch(self, prompts: list[Prompt]) -> Pending:
        number = sum(1 for kind, _ in self.events if kind == "launch")
        self.events.append(("launch", number))
        tokens = sum(c.length for c in prompts)

        clock = self.clock
        ends = self.free = max(clock.t, self.free) + self.seconds if clock is not None else 0.0  # one after another

        def finish() -> PackRun:
            if clock is not None:
                clock.until(ends)
            self.events.append(("wait", number))
            scores = [torch.zeros(len(c.questions), self.verbalizers) for c in prompts]
            return PackRun(scores, tokens, tokens, None, False, self.seconds if clock else 0.0)

        if self.synchronous:
            return Pending(finish, finished=lambda: True)
        return Pending(finish, finished=(lambda: clock.t >= ends) if clock is not None else None)


def items(model, lengths):
    request = Request.model_validate({"state": "x", "questions": {"spam": {"type": "noul"}}})
    [template] = Encoder(model).prompts(request)
    out = []
    for i, n in enumerate(lengths):
        prompt = Prompt(input_ids=torch.zeros(n, dtype=torch.long), rows=torch.tensor([n - 1]),
                      questions=template.questions)
        entry = Delivery.parse(REQUESTS, "k", f"{i}-0", {b"body": json.dumps({"id": f"r{i}"}).encode()}, 1)
        task = Task(entry, entry.identity, request, prompts=[prompt], remaining=1)
        out.append(Item(task, 0, prompt))
    return out


def run(model, lengths, synchronous: bool = False):
    clock = StepClock()
    packer = Packer(BUDGET, max_wait=0.0, clock=clock)
    packer.policy.costs.observe(BUDGET, 0.05)
    for item in items(model, lengths):
        packer.put([item])
    engine = RecordingEngine(int(model.model.proj.out_features), synchronous, None if synchronous else clock)
    handed = []

    class Sink:
        def hand_over(self, *events):
            handed.extend(events)

    metrics = Metrics()
    compute = Compute(model, engine, packer, metrics, Sink())
    compute.run(done=lambda: not any(packer.lanes.values()))
    launches = sum(1 for event in engine.events if event[0] == "launch")
    assert metrics.registry.get_sample_value("dq_pack_launch_seconds_count") == launches  # each launch timed
    answered = [event.item.task.request_id for event in handed if isinstance(event, Computed)]
    assert sorted(answered) == sorted(f"r{i}" for i in range(len(lengths)))  # every prompt answered once
    launched = [item.task.request_id for event in handed if isinstance(event, Launched) for item in event.items]
    assert sorted(launched) == sorted(answered)  # each prompt's pack reported launched ...
    for event in handed:  # ... before its answers
        if isinstance(event, Computed):
            assert any(isinstance(e, Launched) and event.item in e.items for e in handed[:handed.index(event)])
    return engine.events


def test_a_full_next_pack_is_launched_before_the_previous_is_read_out(loaded):
    events = run(loaded("repo-text"), [50, 50, 50, 45, 50, 50])  # three packs, each at least 90% full
    assert events == [("launch", 0), ("launch", 1), ("wait", 0), ("launch", 2), ("wait", 1), ("wait", 2)]


def test_a_partial_next_pack_is_launched_before_the_previous_is_read_out_just_before_it_ends(loaded):
    events = run(loaded("repo-text"), [50, 50, 30])  # a full pack, then a partial one
    assert events == [("launch", 0), ("launch", 1), ("wait", 0), ("wait", 1)]


def test_behind_a_pack_done_already_the_next_waits_until_it_is_read_out(loaded):
    """A synchronous engine (the reference engine on the CPU) has computed a pack by the time its launch returns:
    launching the next first would keep its answers waiting for a whole pack."""
    events = run(loaded("repo-text"), [50, 50, 50, 45, 30], synchronous=True)
    assert events == [("launch", 0), ("wait", 0), ("launch", 1), ("wait", 1), ("launch", 2), ("wait", 2)]


def test_a_failed_gpu_ends_the_worker_through_the_exit_seam_it_is_given(loaded):
    """A GPU that fails (a CUDA error, not a bad prompt) ends the process with 70 through the daemon's exit seam,
    which in-process tests replace; its pack is not bisected or failed prompt by prompt."""
    model = loaded("repo-text")
    packer = Packer(BUDGET, max_wait=0.0)
    for item in items(model, [50, 40]):
        packer.put([item])
    exits, handed = [], []

    class FailedGpu(RecordingEngine):
        def launch(self, prompts):
            raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    class Sink:
        def hand_over(self, *events):
            handed.extend(events)

    compute = Compute(model, FailedGpu(int(model.model.proj.out_features)), packer, Metrics(), Sink(),
                      fatal=exits.append)
    compute.run(done=lambda: bool(exits))
    assert exits == [70] and not [event for event in handed if isinstance(event, Failed)]


def test_work_arriving_while_a_pack_runs_joins_the_next_pack(loaded):
    """The next pack is formed just before the running one ends, with what came meanwhile (formed at the first one's
    launch it would leave the late arrivals a pack further behind)."""
    model = loaded("repo-text")
    first, queued, *late = items(model, [30, 20, 20, 20])
    clock = StepClock()
    packer = Packer(BUDGET, max_wait=0.0, clock=clock)
    packer.policy.costs.observe(BUDGET, 0.05)
    engine = RecordingEngine(int(model.model.proj.out_features), clock=clock)
    launch, packs = engine.launch, []

    def launching(prompts):
        packs.append(len(prompts))
        if len(packs) == 1:  # while the first pack runs, two more prompts arrive
            clock.at(clock.t + 0.02, lambda: packer.put(late))
        return launch(prompts)

    engine.launch = launching
    packer.put([first])

    class Sink:
        def hand_over(self, *events):
            if isinstance(events[0], Launched) and len(packs) == 1:
                packer.put([queued])  # queued just after the first launch

    Compute(model, engine, packer, Metrics(), Sink()).run(done=lambda: len(packs) >= 2 and not any(
        packer.lanes.values()))
    assert packs == [1, 3]


def test_the_halves_of_a_pack_whose_launch_failed_are_reported_launched(loaded):
    """Bisected after a failed launch, each half that runs is reported launched before its answers: its tasks move
    to computing, and their time computing is measured from it (not from zero: dq_request_state_seconds)."""
    model = loaded("repo-text")
    packer = Packer(BUDGET, max_wait=0.0)
    packer.put(items(model, [30, 30]))
    engine = RecordingEngine(int(model.model.proj.out_features), synchronous=True)
    launch, calls, handed = engine.launch, [], []

    def flaky(prompts):
        calls.append(len(prompts))
        if len(calls) == 1:
            raise RuntimeError("a launch that fails once")
        return launch(prompts)

    engine.launch = flaky

    class Sink:
        def hand_over(self, *events):
            handed.extend(events)

    Compute(model, engine, packer, Metrics(), Sink()).run(done=lambda: not any(packer.lanes.values()))
    assert calls == [2, 1, 1]
    computed = [event for event in handed if isinstance(event, Computed)]
    assert len(computed) == 2
    for event in computed:
        launched = [e for e in handed[:handed.index(event)] if isinstance(e, Launched) and event.item in e.items]
        assert launched and 0 < launched[-1].at <= event.at
