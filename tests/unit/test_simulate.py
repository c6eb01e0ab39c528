"""The pack policy's simulation (ops/bench/simulate.py, sim_worker.py): its clock and modelled host and GPU give the
figures their costs say, and the worker's real packer and GPU loop run in it unchanged."""

import random
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "ops" / "bench"
sys.path.insert(0, str(BENCH))

import simulate  # noqa: E402
from sim_worker import HIGH, Costs, Request, Worker  # noqa: E402


def test_a_lone_request_takes_the_sum_of_its_modelled_steps():
    costs = Costs()
    worker = Worker(costs)
    figures = simulate.lone(worker, count=60)
    gpu = max(costs.prelude + costs.gpu(512), costs.launch)  # the 512 size, once its launch's host work is done
    steps = (costs.enqueue + costs.read + costs.plan_alone + gpu + costs.read_out + costs.read_out_prompt
             + costs.settle + costs.wake)
    assert figures["p50_ms"] == figures["p99_ms"] == pytest.approx(1000 * steps, abs=0.01)


def test_every_request_is_answered_once_and_the_clock_never_goes_back():
    worker = Worker(Costs())
    seen, last = [], [worker.sim.t]

    def done(request: Request) -> None:
        assert worker.sim.t >= last[-1]
        last.append(worker.sim.t)
        seen.append(request)

    worker.sim.on_done = done
    rng = random.Random(1)
    normal = simulate.paced(worker, rng, rate=300.0, seconds=1.0, arrivals="poisson")
    high = simulate.paced(worker, rng, rate=30.0, seconds=1.0, arrivals="poisson", lane=HIGH)
    worker.run(lambda: all(r.done for r in normal + high))
    assert len(seen) == len(set(map(id, seen))) == len(normal) + len(high)
    assert all(r.enqueued <= r.taken <= r.queued <= r.done for r in seen)


def test_a_backlog_keeps_the_gpu_busy_with_full_packs_of_the_largest_size():
    worker = Worker(Costs())
    assert simulate.peak(worker, random.Random(2), 600)["ratio"] > 0.97  # nothing in the model stops the host
    sizes, launch = [], worker.engine.launch
    worker.engine.launch = lambda prompts: (sizes.append(sum(p.length for p in prompts)), launch(prompts))[1]
    began, busy = worker.sim.t, worker.engine.busy
    requests = simulate.backlog(worker, simulate.lengths(random.Random(3), 600))
    worker.run(lambda: all(r.done for r in requests))
    assert sum(n for n in sizes if n > 0.9 * 16384) > 0.9 * sum(sizes)
    ended = max(r.done for r in requests)
    assert worker.engine.busy - busy > 0.95 * (ended - began)  # the GPU ran packs all along


def test_an_earlier_commit_s_gpu_stage_runs_in_it_unchanged():
    root = BENCH.parents[1]
    if subprocess.run(["git", "-C", str(root), "cat-file", "-e", "acbedcd:worker/gpu/packer.py"],
                      capture_output=True).returncode:
        pytest.skip("acbedcd is not in this checkout's history")
    worker = Worker(Costs(), "acbedcd")
    figures = simulate.lone(worker, count=60)
    assert 10 < figures["p50_ms"] < 20
