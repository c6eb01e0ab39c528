"""Packs filled high-priority first, with a share kept for normal work (worker/gpu/packer.py)."""

import threading
import time

import torch

from producer.wire.keys import HIGH, NORMAL, Keys
from producer.wire.schema import Request
from worker.entries import REQUESTS, Delivery
from worker.gpu.packer import Packer
from worker.model.engine import Prompt
from worker.tasks import Item, Task

REQUEST = Request.model_validate({"state": "x", "questions": {"spam": {"type": "noul"}}})


def item(lane, tokens: int, name: str) -> Item:
    entry = Delivery.parse(REQUESTS, Keys().requests_in(lane), "1-0", {b"body": b"{}"}, 1, lane=lane)
    prompt = Prompt(input_ids=torch.zeros(tokens, dtype=torch.long), rows=torch.tensor([tokens - 1]), questions=())
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


def test_packs_shrink_to_the_high_budget_while_high_work_flows():
    packer = fill(Packer(400, max_wait=0.0, high_budget=100), *[item(NORMAL, 50, f"n{i}") for i in range(20)])
    assert lane_tokens(packer.next(), NORMAL) == 400 and packer.budget == 400
    packer.put([item(HIGH, 50, "h0")])
    pack = packer.next()
    assert "h0" in names(pack) and sum(one.tokens for one in pack) == 100 and packer.budget == 100
    assert sum(one.tokens for one in packer.next()) == 100  # just after high work: still small
    packer.high_seen -= 10  # a while without high work: full packs again
    assert sum(one.tokens for one in packer.next()) == 400


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


def test_a_busy_gpu_gets_only_a_pack_that_fills_a_static_size():
    packer = fill(Packer(2048, max_wait=0.0, sizes=(512, 1024, 2048)),
                  *[item(NORMAL, n, f"n{i}") for i, n in enumerate([300, 200, 200])])
    assert names(packer.next(behind=1)) == ["n0", "n1"]  # 500 of 512; 1024 would be padded by a third
    assert packer.next(behind=1) == []  # 200 fills nothing: it waits for the pack on the GPU to end ...
    assert names(packer.next()) == ["n2"]  # ... and then goes, with whatever came meanwhile


def test_a_backlog_still_makes_full_budget_packs():
    packer = fill(Packer(2048, max_wait=0.0, sizes=(512, 1024, 2048)),
                  *[item(NORMAL, 256, f"n{i}") for i in range(20)])
    assert sum(one.tokens for one in packer.next(behind=1)) == 2048
    assert sum(one.tokens for one in packer.next(behind=1)) == 2048
    assert sum(one.tokens for one in packer.next(behind=1)) == 1024  # 1024 left: the size it fills
    assert packer.next(behind=1) == [] and not any(packer.lanes.values())


def test_a_task_s_prompts_are_queued_at_once():
    packer = Packer(2048, max_wait=0.0)
    first, second = item(NORMAL, 100, "a"), item(NORMAL, 100, "b")
    packer.put([first, second])
    assert len(packer.next(wait=False)) == 2 and packer.tokens[NORMAL] == 0


def test_behind_a_large_pack_only_a_small_one_is_launched_while_the_high_lane_is_in_use():
    """The first high request after a spell of normal work then waits for the running pack and a small one, never
    for two full ones; a worker without high work keeps full packs back to back."""
    packer = fill(Packer(2048, max_wait=0.0, high_budget=512, sizes=(512, 1024, 2048)),
                  *[item(NORMAL, 256, f"n{i}") for i in range(20)])
    assert sum(one.tokens for one in packer.next(behind=2048)) == 2048  # no high work ever: full behind full
    packer.high_seen = time.monotonic() - 10  # high work ten seconds ago: the lane is in use
    assert sum(one.tokens for one in packer.next(behind=2048)) == 512
    assert sum(one.tokens for one in packer.next(behind=512)) == 2048


def test_behind_a_running_pack_none_is_launched_that_would_be_mostly_padding():
    """Two 9000-token prompts queue 18000 tokens but make a 9000-token pack, 55% of its 16384 bucket: it waits, and
    the queue is left as it was."""
    packer = fill(Packer(16384, max_wait=0.0, sizes=(512, 1024, 2048, 4096, 8192, 16384)),
                  item(NORMAL, 9000, "a"), item(NORMAL, 9000, "b"))
    assert packer.next(behind=16000) == []
    assert names(packer.next()) == ["a"] and packer.tokens[NORMAL] == 9000  # on an idle GPU, as before
    one = fill(Packer(2048, max_wait=0.0, sizes=(512, 1024, 2048)), item(NORMAL, 600, "long"))
    assert one.next(behind=2048) == [] and names(one.next()) == ["long"]  # 600 tokens would pad 1024
