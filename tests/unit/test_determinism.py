"""Deterministic mode (``--deterministic``) on the reference engine: a prompt's scores are bitwise the same alone, in
any pack at any place, and in another process; elsewhere the setting is refused, not ignored."""

import multiprocessing
import random

import pytest
import torch

from test_fast_cpu import prompts_of
from worker.config import Settings
from worker.daemon import create_engine
from worker.model.reference import ReferenceAdapter


def scores(engine, pack):
    return engine.launch(pack).wait().scores


def packs_around(count, index, rng):
    """Packs (indices) holding prompt ``index``, with its place: first, last, and among a random draw of the others
    (repeats included)."""
    others = [i for i in range(count) if i != index]
    yield [index, *others], 0
    yield [*others, index], len(others)
    for _ in range(3):
        crowd = [rng.choice(others) for _ in range(rng.randint(1, 6))]
        at = rng.randint(0, len(crowd))
        yield crowd[:at] + [index] + crowd[at:], at


def test_a_prompt_scores_the_same_bits_alone_and_in_any_pack(loaded):
    model = loaded("repo", 140)  # short prompts beside long ones, images among them
    prompts = prompts_of(model)
    rng = random.Random(3)
    apart = {}
    for deterministic in (True, False):
        engine = ReferenceAdapter(model, Settings(deterministic=deterministic))
        alone = [scores(engine, [prompt])[0] for prompt in prompts]
        worst = 0.0
        for index in range(len(prompts)):
            for pack, at in packs_around(len(prompts), index, rng):
                got = scores(engine, [prompts[i] for i in pack])[at]
                if deterministic:
                    assert torch.equal(got, alone[index]), (index, (got - alone[index]).abs().max())
                worst = max(worst, (got - alone[index]).abs().max().item())
        apart[deterministic] = worst
    print(f"largest score difference alone against packed: deterministic {apart[True]:g}, default {apart[False]:g}")


def _scores_in_a_fresh_process(checkpoint_dir, out):
    from worker.model import checkpoint

    model = checkpoint.load(checkpoint_dir, device="cpu", max_prompt_tokens=140)
    engine = ReferenceAdapter(model, Settings(deterministic=True))
    out.put([s.tolist() for s in scores(engine, prompts_of(model)[::-1])])


def test_another_worker_process_computes_the_same_bits(loaded, checkpoints):
    model = loaded("repo", 140)
    engine = ReferenceAdapter(model, Settings(deterministic=True))
    here = [scores(engine, [prompt])[0] for prompt in prompts_of(model)]
    context = multiprocessing.get_context("spawn")  # a fresh interpreter, as a second worker is
    queue = context.Queue()
    child = context.Process(target=_scores_in_a_fresh_process, args=(checkpoints["repo"], queue))
    child.start()
    there = [torch.tensor(s) for s in queue.get(timeout=120)][::-1]
    child.join(30)
    assert child.exitcode == 0
    assert all(torch.equal(a, b) for a, b in zip(here, there, strict=True))


@pytest.mark.parametrize("engine", ["fast", "auto-on-cuda"])
def test_where_it_is_not_built_deterministic_mode_is_refused_naming_what_runs_it(loaded, engine, monkeypatch):
    model = loaded("repo")
    assert isinstance(create_engine(model, Settings(deterministic=True)), ReferenceAdapter)  # auto on the CPU
    if engine == "auto-on-cuda":  # auto picks the fast engine on a GPU, which deterministic mode does not cover
        monkeypatch.setattr(type(model), "device", property(lambda _: torch.device("cuda")))
    with pytest.raises(ValueError) as refused:
        create_engine(model, Settings(deterministic=True, engine=engine.split("-")[0]))
    assert "--deterministic (DQ_DETERMINISTIC)" in str(refused.value)
    assert "--device cpu --engine reference" in str(refused.value)
