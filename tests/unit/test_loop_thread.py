"""The loop thread's parts (worker/loop/thread.py), built by its constructor: a held entry's state, one field set
at each step of its life (``State``, worker/tasks.py), by the lifecycle and the settle loop on a real event loop,
the GPU thread's events handed over as compute hands them; the planner, the consumer and the Redis side stand in
(this is about the order of states, not Redis: tests/redis/ has the rest); so are cancels: honoured while every
prompt of the entry waits in the packer, too late once one is packed. And the GPU's events once the loop closed."""

import asyncio
import json
import time
from concurrent.futures import Future

import torch

from producer.wire.schema import ErrorCode, Request
from worker.config import Settings
from worker.entries import REQUESTS, Delivery, Refusal
from worker.gpu.packer import Packer
from worker.loop.publisher import Settlement
from worker.loop.thread import LoopThread
from worker.metrics import Metrics
from worker.model.engine import Prompt
from worker.tasks import Computed, Expired, Failed, Launched, State, Task

REQUEST = Request.model_validate({"state": "x", "questions": {"q": {"type": "noul"}}})
NOW = 2 ** 50  # a cancel notice's time (ms): after the entries of these tests (entry id 1-0)


class Planner:
    """Plans each entry into a one-prompt task (or a refusal), when the test says so."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse, self.waiting, self.alone = refuse, [], []

    def submit(self, delivery: Delivery, stored_body: bytes | None = None, alone: bool = False) -> Future:
        out: Future = Future()
        self.waiting.append((delivery, out))
        self.alone.append(alone)
        return out

    async def finish(self) -> None:
        """Plan what was submitted (the lifecycle's planning step runs first, on the loop)."""
        await turn()
        for delivery, out in self.waiting:
            if self.refuse:
                out.set_result(Refusal(delivery.identity, ErrorCode.INVALID_REQUEST, "refused"))
            else:
                prompt = Prompt(input_ids=torch.zeros(8, dtype=torch.long), rows=torch.tensor([7]), questions=())
                out.set_result(Task(delivery, delivery.identity, REQUEST, prompts=[prompt], remaining=1))
        self.waiting.clear()


class Redis:
    """The Redis side of the consumer and the publisher: every call answers at once, and is recorded."""

    def __init__(self) -> None:
        self.settled, self.dead = [], []
        self.cancelled = False  # what the take function answers (a cancel came before the take)

    async def claim_again(self, delivery: Delivery) -> Delivery:
        return delivery.again()

    async def take_check(self, task: Task) -> tuple[None, bool]:  # no stored result; cancelled before the take?
        return None, self.cancelled

    async def settle(self, outcomes):
        self.settled += outcomes
        self.dead += [outcome.delivery.entry_id for outcome in outcomes if outcome.dead_letter]  # with its result
        return Settlement(settled=[(outcome, outcome.result, True) for outcome in outcomes])

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        self.dead.append(delivery.entry_id)


def scenario(steps, max_deliveries: int = 5, refuse: bool = False):
    """Run ``steps(loop, planner, packer, redis, entry, state)`` on the loop thread's parts, built by its constructor
    on a running event loop; ``state()`` the held state now (None once let go)."""
    async def run():
        redis, planner, packer = Redis(), Planner(refuse), Packer(100, max_wait=0.0)
        loop = LoopThread(Settings(max_deliveries=max_deliveries), Metrics(), planner, packer, served=("tiny",),
                          event_loop=asyncio.get_running_loop())
        loop.consumer.claim_again = redis.claim_again
        loop.publisher.settle, loop.publisher.dead_letter = redis.settle, redis.dead_letter
        loop.cancels.take_check = redis.take_check
        settling = asyncio.ensure_future(loop.settler.run())
        delivery = Delivery.parse(REQUESTS, "k", "1-0", {b"body": json.dumps({"id": "r"}).encode()}, 1)
        entry = ("k", "1-0")

        def state():
            held = loop.held.get(entry)
            return None if held is None else held.state

        try:
            await steps(loop, planner, packer, redis, delivery, state)
        finally:
            settling.cancel()

    asyncio.run(asyncio.wait_for(run(), timeout=10))


async def turn(times: int = 5) -> None:
    for _ in range(times):  # callbacks handed over, futures resolved, the settle loop's batch
        await asyncio.sleep(0)


async def until(done, seconds: float = 2.0) -> None:
    """Turns until ``done()``: for a step whose number of turns is not the test's point (a settle under a
    loaded machine took more than ten once)."""
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        await asyncio.sleep(0.001)


def test_an_answered_entry_goes_taken_planning_queued_computing_settling_then_is_let_go():
    async def steps(loop, planner, packer, redis, delivery, state):
        loop.lifecycle.take(delivery, "read")
        assert state() == State.PLANNING  # routed at once: taken, then handed to the planners
        await planner.finish()
        await turn()
        assert state() == State.QUEUED and loop.held.get(("k", "1-0")).task.request_id == "r"
        [item] = packer.next(wait=False)
        loop.hand_over(Launched((item,)))  # as compute does, on the GPU thread
        await turn()
        assert state() == State.COMPUTING
        loop.hand_over(Computed(item, [], 0.01))
        await asyncio.sleep(0)
        assert state() == State.SETTLING  # handed to the settle loop, not yet settled
        await turn()
        assert state() is None and [o.request_id for o in redis.settled] == ["r"]

    scenario(steps)


def test_a_failed_pack_takes_the_entry_again_then_queues_its_task_again():
    async def steps(loop, planner, packer, redis, delivery, state):
        loop.lifecycle.take(delivery, "read")
        await planner.finish()
        await turn()
        [item] = packer.next(wait=False)
        loop.hand_over(Launched((item,)))
        loop.hand_over(Failed(item.task, "RuntimeError: boom"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert state() in (State.TAKEN, State.QUEUED)  # taken again: its claim answered at once here
        await turn()
        held = loop.held.get(("k", "1-0"))
        assert held.state == State.QUEUED and held.delivery.deliveries == 2 and held.task is not item.task
        [again] = packer.next(wait=False)
        assert again.task is held.task and item.task.closed
        loop.hand_over(Computed(item, [], 0.01))  # the failed task's late answer changes nothing
        await turn()
        assert state() == State.QUEUED and not redis.settled

    scenario(steps)


def test_the_last_delivery_failing_is_dead_lettered_while_settling():
    async def steps(loop, planner, packer, redis, delivery, state):
        loop.lifecycle.take(delivery, "read")
        await planner.finish()
        await turn()
        [item] = packer.next(wait=False)
        loop.hand_over(Failed(item.task, "RuntimeError: boom"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert state() == State.SETTLING
        await turn(10)
        assert state() is None and redis.dead == ["1-0"]
        assert redis.settled[0].result.error.code == ErrorCode.DEAD_LETTERED

    scenario(steps, max_deliveries=1)


def test_an_expired_task_and_a_refused_entry_go_straight_to_settling():
    async def expired(loop, planner, packer, redis, delivery, state):
        loop.lifecycle.take(delivery, "read")
        await planner.finish()
        await turn()
        [item] = packer.next(wait=False)
        loop.hand_over(Expired(item.task))
        await asyncio.sleep(0)
        assert state() == State.SETTLING
        await turn()
        assert state() is None and redis.settled[0].result.error.code == ErrorCode.DEADLINE_EXCEEDED

    async def refused(loop, planner, packer, redis, delivery, state):
        loop.lifecycle.take(delivery, "read")
        assert state() == State.PLANNING
        await planner.finish()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert state() == State.SETTLING and not any(packer.lanes.values())
        await turn()
        assert state() is None and redis.settled[0].result.error.code == ErrorCode.INVALID_REQUEST

    scenario(expired)
    scenario(refused, refuse=True)


def cancels(metrics: Metrics) -> dict[str, float]:
    return {outcome: metrics.cancels.labels(outcome)._value.get() for outcome in ("honoured", "too_late")}


def test_a_cancel_notice_drops_a_queued_entry_before_it_is_packed():
    async def steps(loop, planner, packer, redis, delivery, state):
        loop.lifecycle.take(delivery, "read")
        await planner.finish()
        await turn()
        assert state() == State.QUEUED
        loop.cancels._learn("r", NOW)  # a notice read for its request
        assert state() == State.SETTLING and packer.next(wait=False) == []  # withdrawn: nothing left to pack
        await turn()
        assert state() is None and redis.settled[0].result.error.code == ErrorCode.CANCELLED
        assert cancels(loop.lifecycle.metrics) == {"honoured": 1, "too_late": 0}

    scenario(steps)


def test_a_cancel_notice_after_the_pack_took_a_prompt_is_too_late():
    async def steps(loop, planner, packer, redis, delivery, state):
        loop.lifecycle.take(delivery, "read")
        await planner.finish()
        await turn()
        [item] = packer.next(wait=False)  # packed on the GPU thread; its Launched event not handled yet
        loop.cancels._learn("r", NOW)
        assert state() == State.QUEUED and not item.task.closed
        loop.hand_over(Launched((item,)))
        loop.hand_over(Computed(item, [], 0.01))
        await turn()
        assert state() is None and redis.settled[0].result.status == "ok"  # answered normally
        assert cancels(loop.lifecycle.metrics) == {"honoured": 0, "too_late": 1}

    scenario(steps)


def test_a_cancel_during_planning_or_before_the_take_drops_the_entry_once_planned():
    async def noticed(loop, planner, packer, redis, delivery, state):
        loop.lifecycle.take(delivery, "read")
        loop.cancels._learn("r", NOW)  # while planning: nothing to withdraw yet
        assert state() == State.PLANNING
        await planner.finish()
        await turn()
        assert state() is None and not any(packer.lanes.values())
        assert redis.settled[0].result.error.code == ErrorCode.CANCELLED
        assert cancels(loop.lifecycle.metrics) == {"honoured": 1, "too_late": 0}

    async def at_take(loop, planner, packer, redis, delivery, state):
        redis.cancelled = True  # the take function found the record cancelled
        loop.lifecycle.take(delivery, "read")
        await planner.finish()
        await turn()
        assert state() is None and not any(packer.lanes.values())
        assert redis.settled[0].result.error.code == ErrorCode.CANCELLED

    async def before_read(loop, planner, packer, redis, delivery, state):
        loop.cancels._learn("r", NOW)
        loop.lifecycle.take(delivery, "read")  # not even planned
        assert state() == State.SETTLING and not planner.waiting
        await until(lambda: state() is None)
        assert state() is None and redis.settled[0].result.error.code == ErrorCode.CANCELLED

    for steps in (noticed, at_take, before_read):
        scenario(steps)


def test_a_cancel_notice_older_than_the_entry_leaves_it_alone():
    """The id was sent again after its cancel: another request, served as any other."""
    async def steps(loop, planner, packer, redis, delivery, state):
        loop.cancels._learn("r", 0)  # a notice of a cancel before this entry was enqueued (entry id 1-0)
        loop.lifecycle.take(delivery, "read")
        await planner.finish()
        await turn()
        assert state() == State.QUEUED
        loop.cancels._learn("r", 0)
        assert state() == State.QUEUED and cancels(loop.lifecycle.metrics) == {"honoured": 0, "too_late": 0}

    scenario(steps)


def test_a_pack_finishing_after_a_stop_closed_the_loop_is_dropped_not_raised():
    """At the drain deadline the asyncio loop closes while a pack may still finish on the GPU thread: its answers
    are dropped (the entries stay pending, reclaimed elsewhere); it once ended the worker with exit 1 and a traceback."""
    closed = asyncio.new_event_loop()
    closed.close()
    loop = LoopThread(Settings(), Metrics(), planner=None, packer=None, event_loop=closed)
    for event in (Launched(()), Computed(None, [], 0.0), Failed(None, "x"), Expired(None)):
        loop.hand_over(event)


def test_an_entry_is_planned_as_alone_while_the_others_held_are_only_being_settled():
    """A lone caller's next request is often taken while its last one, answered, is still being acknowledged: no
    pack runs beside it, so it is planned in the worker's own thread (no hop to a planner process)."""
    async def steps(loop, planner, packer, redis, delivery, state):
        loop.lifecycle.take(delivery, "read")
        await turn()
        loop.held.move(delivery, State.SETTLING)  # answered, its acknowledgement under way
        second = Delivery.parse(REQUESTS, "k", "2-0", {b"body": json.dumps({"id": "s"}).encode()}, 1)
        loop.lifecycle.take(second, "read")
        await turn()
        third = Delivery.parse(REQUESTS, "k", "3-0", {b"body": json.dumps({"id": "t"}).encode()}, 1)
        loop.lifecycle.take(third, "read")  # beside the second, being planned: not alone
        await turn()
        assert planner.alone == [True, True, False]

    scenario(steps)
