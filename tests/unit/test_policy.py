"""The pack policy (worker/gpu/policy.py): what each size costs, learned; a pack's size from what is queued and the
oldest high request's wait."""

import pytest

from producer.wire.keys import HIGH, NORMAL
from worker.gpu.policy import PRIOR_FIXED_S, PRIOR_PER_TOKEN_S, Costs, Policy, Waiting

SIZES = (512, 1024, 2048, 4096, 8192, 16384)


def h100() -> Policy:
    """The costs of docs/BENCHMARKS.md's H100, 2B bf16 (the prior's line): 512 6.3 ms ... 16384 84.1 ms."""
    policy = Policy(16384, SIZES, high_target=0.1)
    for size in SIZES:
        policy.costs.observe(size, PRIOR_FIXED_S + PRIOR_PER_TOKEN_S * size)
    return policy


def waiting(tokens: int, high_tokens: int = 0, high_since: float | None = None) -> Waiting:
    return Waiting(tokens, high_tokens, {NORMAL: 0.0 if tokens > high_tokens else None, HIGH: high_since})


def test_a_size_s_cost_is_learned_from_its_runs_and_estimated_between_and_beyond_them():
    costs = Costs()
    assert costs.seconds(512) == pytest.approx(PRIOR_FIXED_S + PRIOR_PER_TOKEN_S * 512)  # nothing run: the prior
    costs.observe(1024, 0.010)
    assert costs.seconds(2048) == pytest.approx(0.010 * (PRIOR_FIXED_S + PRIOR_PER_TOKEN_S * 2048)
                                                / (PRIOR_FIXED_S + PRIOR_PER_TOKEN_S * 1024))  # the prior's shape
    costs.observe(4096, 0.040)
    assert costs.seconds(2048) == pytest.approx(0.020)  # between the two run: on their line
    assert costs.seconds(8192) == pytest.approx(0.080)  # beyond: on the line through the nearest two
    costs.observe(1024, 0.300)  # a pack stretched by a pause of the host
    assert costs.seconds(1024) == pytest.approx(0.155)  # the median of two
    for _ in range(3):
        costs.observe(1024, 0.010)
    assert costs.seconds(1024) == pytest.approx(0.010)  # the pause is one run of five: it no longer counts


def test_everything_queued_goes_in_the_smallest_size_that_holds_it():
    policy = h100()
    assert [policy.size(waiting(n), 0.0) for n in (300, 900, 1900, 3900, 16000, 40000)] == [
        512, 1024, 2048, 4096, 16384, 16384]


def test_tokens_just_over_a_size_go_in_the_size_below_then_a_pack_of_the_rest():
    """4983 tokens: 8192 would run 44 ms; 4096 and then 1024 for the rest 33 ms, the first ones sooner. 7000: the
    rest would need 4096 too (48 ms): one 8192. 1100: 1024 and 512 (15 ms) against 2048 (14 ms): one 2048."""
    policy = h100()
    assert policy.size(waiting(4983), 0.0) == 4096
    assert policy.size(waiting(7000), 0.0) == 8192
    assert policy.size(waiting(1100), 0.0) == 2048
    assert policy.size(waiting(9000), 0.0) == 8192  # the largest padded by 45%: 8192 and then 1024


def test_a_pack_with_high_work_ends_within_the_oldest_high_request_s_target():
    policy = h100()  # target 100 ms
    assert policy.size(waiting(40000, 500, high_since=0.0), start=0.0) == 16384  # 84 ms: in time
    assert policy.size(waiting(40000, 500, high_since=0.0), start=0.05) == 8192  # 50 ms left: 44
    assert policy.size(waiting(40000, 500, high_since=0.0), start=0.09) == 1024  # 10 ms left: 8.8
    # Late already: the smallest size that holds the high work, whatever normal work waits
    assert policy.size(waiting(40000, 500, high_since=0.0), start=0.2) == 512
    assert policy.size(waiting(40000, 3000, high_since=0.0), start=0.2) == 4096


def test_an_engine_without_static_sizes_is_sized_in_powers_of_two_up_to_its_budget():
    assert Policy(3000, (), high_target=0.1).sizes == (512, 1024, 2048, 3000)
    assert Policy(200, (), high_target=0.1).sizes == (200,)
