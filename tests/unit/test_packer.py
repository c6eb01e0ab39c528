"""Packs filled high-priority first, with a share kept for normal work, launched behind a running pack just before
it ends (worker/gpu/packer.py)."""

import threading
import time

import torch

from producer.wire.keys import HIGH, NORMAL, Keys
from producer.wire.schema import Request
from step_clock import StepClock
from worker.entries import REQUESTS, Delivery
from worker.gpu.packer import Packer
from worker.model.engine import Prompt
from worker.tasks import Item, Task

REQUEST = Request.model_validate({"state": "x", "questions": {"spam": {"type": "noul"}}})


SIZES = (512, 1024, 2048)


class Running:
    """A pack's Pending as the packer sees it: done or not."""

    def __init__(self, done: bool = False) -> None:
        self.finished = done

    def done(self) -> bool:
        return self.finished


def running(packer: Packer, tokens: int, seconds: float, done: bool = False) -> Running:
    """A pack of ``tokens`` launched now on an idle GPU, whose size the packer expects to run ``seconds``."""
    packer.policy.costs.observe(packer.policy.holding(tokens), seconds)
    pending = Running(done)
    packer.launched(tokens, packer.clock.now(), pending)
    return pending


def item(lane, tokens: int, name: str, questions: int = 0) -> Item:
    entry = Delivery.parse(REQUESTS, Keys().requests_in(lane), "1-0", {b"body": b"{}"}, 1, lane=lane)
    prompt = Prompt(input_ids=torch.zeros(tokens, dtype=torch.long), rows=torch.tensor([tokens - 1]),
                    questions=(None,) * questions)
    task = Task(entry, entry.identity, REQUEST, prompts=[prompt], remaining=1)
    task.name = name  # for the assertions
    return Item(task, 0, prompt)


def fill(packer: Packer, *items: Item) -> Packer:
    for one in items:
        packer.put([one])
    return packer


def names(pack: list[Item]) -> list[str]:
    return [one.task.name for one in pack]


def lane_tokens(pack: list[Item], lane) -> int:
    return sum(one.tokens for one in pack if one.lane == lane)


def test_high_chunks_queued_after_a_normal_backlog_go_into_the_next_pack():
    packer = fill(Packer(200, max_wait=0.0, normal_share=0.25),
                  *[item(NORMAL, 50, f"n{i}") for i in range(10)], item(HIGH, 50, "h0"), item(HIGH, 50, "h1"))
    first = packer.next()
    assert {"h0", "h1"} <= set(names(first)) and lane_tokens(first, NORMAL) == 100
    assert names(packer.next()) == ["n2", "n3", "n4", "n5"]  # normal in its order, nothing skipped


def test_normal_work_gets_its_share_of_every_pack_under_a_flood_of_high_work():
    packer = fill(Packer(200, max_wait=0.0, normal_share=0.25),
                  *[item(HIGH, 50, f"h{i}") for i in range(40)], *[item(NORMAL, 50, f"n{i}") for i in range(4)])
    packs = [packer.next() for _ in range(5)]
    assert [lane_tokens(pack, NORMAL) for pack in packs] == [50, 50, 50, 50, 0]
    assert all(sum(one.tokens for one in pack) == 200 for pack in packs)  # high fills the rest: packs stay full


def test_a_normal_prompt_longer_than_the_share_gets_in_once_enough_is_owed():
    packer = fill(Packer(200, max_wait=0.0, normal_share=0.25),
                  *[item(HIGH, 50, f"h{i}") for i in range(40)], item(NORMAL, 150, "long"))
    packs = [packer.next() for _ in range(3)]
    assert "long" not in names(packs[0]) + names(packs[1])
    assert "long" in names(packs[2]) and lane_tokens(packs[2], HIGH) == 50


def test_a_normal_prompt_longer_than_a_pack_runs_alone_once_a_whole_pack_is_owed():
    packer = fill(Packer(200, max_wait=0.0, normal_share=0.25),
                  *[item(HIGH, 50, f"h{i}") for i in range(40)], item(NORMAL, 300, "huge"))
    packs = [packer.next() for _ in range(4)]
    assert names(packs[3]) == ["huge"] and all("huge" not in names(pack) for pack in packs[:3])
    assert lane_tokens(packer.next(), HIGH) == 200  # then high again, nothing owed


def test_a_high_prompt_larger_than_the_room_left_by_the_share_still_opens_the_pack():
    packer = fill(Packer(200, max_wait=0.0, normal_share=0.25),
                  *[item(NORMAL, 20, f"n{i}") for i in range(30)], item(HIGH, 190, "big"))
    first = packer.next()
    assert names(first)[0] == "big" and sum(one.tokens for one in first) <= 200


def test_normal_work_alone_fills_packs_first_fit_in_order():
    packer = fill(Packer(100, max_wait=0.0), *[item(NORMAL, n, f"n{i}") for i, n in enumerate([60, 50, 30, 40])])
    assert names(packer.next()) == ["n0", "n2"]  # n1 does not fit beside n0; n2 does
    assert names(packer.next()) == ["n1", "n3"]
    assert not any(packer.lanes.values()) and packer.next(timeout=0.01) == []


def test_a_prompt_of_many_questions_takes_eight_tokens_of_room_per_question():
    """Prompt.room: a bucket's graphs compute one marker row per 8 of its tokens, so a pack the packer makes never
    has more questions than its bucket's rows (worker/fast/layout.py) and never leaves the graphs for that."""
    crowded = [item(NORMAL, 40, f"q{i}", questions=20) for i in range(4)]  # 40 tokens, 160 of room each
    packer = fill(Packer(512, max_wait=0.0), *crowded, item(NORMAL, 30, "plain", questions=2))
    assert [one.tokens for one in crowded] == [160] * 4
    assert names(packer.next()) == ["q0", "q1", "q2", "plain"]  # 510 of room, 150 real tokens
    assert names(packer.next()) == ["q3"]


def test_a_partly_filled_pack_waits_at_most_max_wait_for_more():
    packer = fill(Packer(1000, max_wait=0.2), item(NORMAL, 50, "n0"))
    threading.Timer(0.05, packer.put, [[item(HIGH, 50, "h0")]]).start()
    start = time.monotonic()
    pack = packer.next()
    assert set(names(pack)) == {"n0", "h0"} and 0.15 < time.monotonic() - start < 1.0


def test_an_idle_gpu_gets_everything_queued_up_to_the_budget():
    packer = fill(Packer(2048, max_wait=0.0, sizes=(512, 1024, 2048)),
                  *[item(NORMAL, n, f"n{i}") for i, n in enumerate([300, 200, 200])])
    assert names(packer.next()) == ["n0", "n1", "n2"]  # 700 tokens, padded to 1024: nothing else would run


def test_behind_a_running_pack_the_next_is_formed_just_before_it_ends_with_what_came_by_then():
    clock = StepClock()
    packer = fill(Packer(2048, max_wait=0.0, sizes=SIZES, clock=clock), item(NORMAL, 300, "n0"))
    running(packer, 2048, seconds=0.05)  # ends at 100.05
    clock.at(100.01, lambda: packer.put([item(NORMAL, 300, "n1")]))
    clock.at(100.03, lambda: packer.put([item(NORMAL, 300, "n2")]))
    clock.at(100.049, lambda: packer.put([item(NORMAL, 300, "late")]))  # after the moment: the next pack
    pack = packer.next(behind=True)
    lead = packer.policy.lead(2048)
    assert names(pack) == ["n0", "n1", "n2"] and abs(clock.t - (100.05 - lead)) < 1e-9
    assert 0.002 <= lead < 0.01


def test_a_pack_done_already_is_read_out_first_and_none_is_formed_behind_it():
    clock = StepClock()
    packer = fill(Packer(2048, max_wait=0.0, sizes=SIZES, clock=clock), item(NORMAL, 300, "n0"))
    running(packer, 2048, seconds=0.05, done=True)  # a synchronous engine's, or one that ended early
    assert packer.next(behind=True) == [] and clock.t == 100.0 and packer.tokens[NORMAL] == 300


def test_nothing_queued_by_the_moment_means_no_pack_behind():
    clock = StepClock()
    packer = Packer(2048, max_wait=0.0, sizes=SIZES, clock=clock)
    running(packer, 2048, seconds=0.05)
    assert packer.next(behind=True) == [] and clock.t < 100.05


def test_a_backlog_makes_full_packs_of_the_largest_size_back_to_back_ahead_of_time():
    """A saturated worker launches each full pack of the largest size as early as a high request arriving just
    after it would still meet its target behind both packs (the host's pauses cannot starve the GPU), never at
    once; what is left, less than a full one, goes just in time."""
    clock = StepClock()
    packer = fill(Packer(2048, max_wait=0.0, sizes=SIZES, clock=clock, high_target=0.1),
                  *[item(NORMAL, 256, f"n{i}") for i in range(20)])
    running(packer, 2048, seconds=0.05)  # runs 100.00 to 100.05
    ahead = 0.1 - 0.05 - packer.policy.costs.seconds(512)
    assert ahead == packer.policy.ahead(2048) and ahead > packer.policy.lead(2048)
    for end in (100.05, 100.10):
        assert sum(one.tokens for one in packer.next(behind=True)) == 2048 and abs(clock.t - (end - ahead)) < 1e-9
        packer.launched(2048, clock.t, Running())  # behind the one running: ends 50 ms after it
    rest = packer.next(behind=True)
    assert sum(one.tokens for one in rest) == 1024 and abs(clock.t - (100.15 - packer.policy.lead(2048))) < 1e-9
    assert not any(packer.lanes.values())


def test_a_high_request_arriving_just_after_a_full_pack_went_ahead_still_meets_its_target():
    """It waits for the pack running and the full one behind it, then goes in a pack sized for what is left of its
    target: within the target, where a full pack launched at once would have made it wait for two whole packs."""
    clock = StepClock()
    packer = fill(Packer(2048, max_wait=0.0, sizes=SIZES, clock=clock, high_target=0.1),
                  *[item(NORMAL, 256, f"n{i}") for i in range(20)])
    for size, seconds in ((512, 0.02), (1024, 0.03), (2048, 0.05)):
        packer.policy.costs.observe(size, seconds)
    running(packer, 2048, seconds=0.05)  # runs 100.00 to 100.05
    pack = packer.next(behind=True)  # 30 ms ahead: 100 ms less 50 for it, 20 for the smallest size
    assert sum(one.tokens for one in pack) == 2048 and abs(clock.t - 100.02) < 1e-9
    packer.launched(2048, clock.t, Running())  # runs 100.05 to 100.10
    arrived = clock.t + 0.001
    clock.at(arrived, lambda: packer.put([item(HIGH, 100, "h0")]))
    pack = packer.next(behind=True)
    assert names(pack)[0] == "h0" and sum(one.tokens for one in pack) <= 512
    assert 100.10 + packer.policy.costs.seconds(512) - arrived <= 0.1 + 1e-9


def test_a_pack_holding_high_work_is_sized_for_the_oldest_high_request_s_target():
    """It waited 30 ms of its 50: the pack that starts when the running one ends (in 10 ms) may run 10 ms at most,
    so the 1024 size (8 ms) and not the 2048 (15 ms) the queue would fill."""
    clock = StepClock()
    packer = Packer(2048, max_wait=0.0, sizes=SIZES, clock=clock, high_target=0.05)
    for size, seconds in ((512, 0.006), (1024, 0.008), (2048, 0.015)):
        packer.policy.costs.observe(size, seconds)
    fill(packer, *[item(NORMAL, 256, f"n{i}") for i in range(8)])
    packer.put([item(HIGH, 200, "h0")], waited=0.03)
    running(packer, 2048, seconds=0.01)
    pack = packer.next(behind=True)
    assert names(pack)[0] == "h0" and sum(one.tokens for one in pack) <= 1024
    assert packer.tokens[NORMAL] > 0  # the rest waits for the next pack


def test_a_long_prompt_behind_a_running_pack_goes_at_the_moment_alone():
    """Two 9000-token prompts fill no size: neither goes at once (it would be 45% padding of the largest size, and
    nothing could join it later), and at the moment the first goes alone."""
    clock = StepClock()
    sizes = (512, 1024, 2048, 4096, 8192, 16384)
    packer = fill(Packer(16384, max_wait=0.0, sizes=sizes, clock=clock), item(NORMAL, 9000, "a"),
                  item(NORMAL, 9000, "b"))
    running(packer, 16000, seconds=0.08)
    assert names(packer.next(behind=True)) == ["a"] and clock.t > 100.07 and packer.tokens[NORMAL] == 9000


def test_the_moment_follows_what_the_packs_run_took():
    """The running pack's end is re-estimated when the pack before it is read out, from its measured run."""
    clock = StepClock()
    packer = Packer(2048, max_wait=0.0, sizes=SIZES, clock=clock)
    first = running(packer, 2048, seconds=0.05)
    second = Running()
    packer.launched(2048, clock.t, second)  # behind the first: expected to start at 100.05
    assert abs(packer.running[-1].ends_at - 100.10) < 1e-9
    clock.t = 100.07
    packer.finished(first, 0.07)  # it ran 70 ms, not 50
    assert abs(packer.running[-1].starts_at - 100.07) < 1e-9
    assert abs(packer.running[-1].ends_at - (100.07 + packer.policy.costs.seconds(2048))) < 1e-9
    assert packer.policy.costs.seconds(2048) > 0.05  # learned


def test_a_large_pack_of_short_high_prompts_is_filled_with_high_work_and_normal_gets_its_share():
    """First fit passes over at most HOLD prompts that do not fit: it once looked at HOLD prompts in all, so a
    16k pack took 128 short high prompts (12k tokens) and normal work filled the rest, far beyond its share."""
    packer = fill(Packer(16384, max_wait=0.0, normal_share=0.1),
                  *[item(HIGH, 50, f"h{i}") for i in range(600)], *[item(NORMAL, 50, f"n{i}") for i in range(100)])
    pack = packer.next(wait=False)
    assert lane_tokens(pack, NORMAL) <= 1650 and lane_tokens(pack, HIGH) + lane_tokens(pack, NORMAL) == 16350


def test_a_pack_that_ends_sooner_than_expected_is_read_out_without_waiting_for_the_moment():
    """A cost overestimated (a pack stretched by a pause of the host) must not leave the GPU idle until the
    expected end: whether the pack is done is looked at every POLL_S while the packer waits."""
    clock = StepClock()
    packer = fill(Packer(2048, max_wait=0.0, sizes=SIZES, clock=clock), item(NORMAL, 300, "n0"))
    pending = running(packer, 2048, seconds=0.5)  # expected to run 500 ms
    pending.done = lambda: clock.t >= 100.03  # it ran 30: nothing tells the packer, it has to look
    assert packer.next(behind=True) == [] and 100.03 <= clock.t < 100.035
