"""Deterministic mode (``--deterministic``): on the reference engine (CPU) a prompt's scores are bitwise the same
alone, in any pack at any place, and in another process; the fast engine's bucketed path keeps one row count per
bucket and the same bits in every bucket (its GPU kernels: tests/gpu/test_bitwise.py); its start refuses GEMMs
that depend on the batch; elsewhere the setting is refused, not ignored."""

import logging
import multiprocessing
import os
import random
import subprocess
import sys

import pytest
import torch

from test_fast import PLAIN_CAPTURE, SMALL, prompts_of
from worker.config import Settings
from worker.daemon import create_engine
from worker.fast import FastEngine, deterministic, ops
from worker.fast.mixers import TorchMixers
from worker.fast.qla import FlashQLA


@pytest.fixture(autouse=True)
def process_settings_kept(monkeypatch):
    """The fast engine's deterministic mode switches process-wide settings (worker/fast/deterministic.py enable): here
    they are recorded, not made, so that later tests in this process run as they would alone; what enable does is
    checked in a process of its own."""
    calls = []
    monkeypatch.setattr(deterministic, "enable", lambda: calls.append("enable"))
    return calls
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
    """Deterministic mode alone: the default mode's differences (up to 2.4e-6 on the tiny checkpoint,
    docs/RELIABILITY.md) were measured here too, asserting nothing, at half the test's time."""
    model = loaded("repo", 140)  # short prompts beside long ones, images among them
    prompts = prompts_of(model)
    rng = random.Random(3)
    engine = ReferenceAdapter(model, Settings(deterministic=True))
    alone = [scores(engine, [prompt])[0] for prompt in prompts]
    for index in range(len(prompts)):
        for pack, at in packs_around(len(prompts), index, rng):
            got = scores(engine, [prompts[i] for i in pack])[at]
            assert torch.equal(got, alone[index]), (index, (got - alone[index]).abs().max())


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


def test_the_fast_engines_deterministic_path_gives_a_prompt_the_same_bits_in_every_bucket_and_place(
        loaded, process_settings_kept):
    """The bucketed path with its stand-ins (plain calls for CUDA graphs, plain-torch mixers): the pruned last
    layer at each bucket's marker rows, every pack the packer can make graphed (it charges questions by
    Prompt.room), and each prompt's scores the same alone, first, last and among others in every bucket. The
    GPU's kernels are tests/gpu/test_bitwise.py's."""
    model = loaded("repo", 140)
    prompts = prompts_of(model)
    settings = Settings(deterministic=True, cuda_graphs=True, buckets="256,512,1024", **SMALL)
    engine = FastEngine(model, settings, mixers=TorchMixers(), capture=PLAIN_CAPTURE)
    engine.warmup()
    assert process_settings_kept == ["enable"]
    assert engine.fwd.pruned and engine.fwd.image_by_image
    assert engine.graphed.ws.rows == 128  # the buckets' marker rows (64, 64, 128), not every token row
    alone = [scores(engine, [prompt])[0] for prompt in prompts]
    rng, buckets = random.Random(5), set()
    for index in range(len(prompts)):
        for pack, at in packs_around(len(prompts), index, rng):
            if sum(prompts[i].room for i in pack) > engine.max_pack_tokens:  # the packer makes no such pack
                continue
            run = engine.launch([prompts[i] for i in pack]).wait()
            assert run.graph
            buckets.add(run.bucket)
            assert torch.equal(run.scores[at], alone[index]), (index, pack)
    assert buckets == {256, 512, 1024}


def test_a_card_that_breaks_the_promise_stops_the_warm_up(loaded):
    """The warm-up's own check (worker/fast/warmup.py, _check_deterministic): probe prompts alone, then first and
    last in packs of every bucket. Mixers whose sums change with the pack's size (as a kernel chosen by the pack
    does) stop the start, saying where."""

    class PackDependent(TorchMixers):
        def attention(self, query, key, value, scale, causal, bounds, rows_only=False):
            out = super().attention(query, key, value, scale, causal, bounds, rows_only)
            return out * (1 + 1e-3 * (bounds.cu_host.numel() > 2))  # another order of sums beside others

    settings = Settings(deterministic=True, cuda_graphs=True, buckets="256,512,1024", **SMALL)
    engine = FastEngine(loaded("repo", 140), settings, mixers=PackDependent(), capture=PLAIN_CAPTURE)
    with pytest.raises(deterministic.NotDeterministic,
                       match="probe prompt scored other bits first in a pack of 2 prompts "
                                                     r"\(bucket 256\)"):
        engine.warmup()


def test_the_check_at_warm_up_fills_small_buckets_exactly_and_never_passes_having_checked_nothing(loaded):
    """Probe packs fill each bucket exactly, also where the buckets are smaller than the usual probe prompts (a
    largest bucket under 128 once crashed the start); buckets too small to hold any probe pack refuse the start."""
    settings = Settings(deterministic=True, cuda_graphs=True, buckets="40,100", **{**SMALL, "pack_tokens": 100})
    engine = FastEngine(loaded("repo"), settings, mixers=TorchMixers(), capture=PLAIN_CAPTURE)
    packs, launch = [], engine.launch
    engine.launch = lambda pack: packs.append([p.length for p in pack]) or launch(pack)
    try:
        engine.warmup()
    except deterministic.NotDeterministic:  # the CPU's BLAS may round a 40-row GEMM otherwise than a 100-row one
        pass
    probed = [pack for pack in packs if len(pack) > 1]
    assert probed and all(sum(pack) in (40, 100) for pack in probed), probed
    tiny_buckets = Settings(deterministic=True, cuda_graphs=True, buckets="3", **{**SMALL, "pack_tokens": 3})
    engine = FastEngine(loaded("repo"), tiny_buckets, mixers=TorchMixers(), capture=PLAIN_CAPTURE)
    with pytest.raises(deterministic.NotDeterministic, match="found no pack to check"):
        engine.warmup()


def test_deterministic_mode_is_refused_where_it_is_not_built_saying_what_runs_it(loaded, monkeypatch):
    model = loaded("repo")
    assert isinstance(create_engine(model, Settings(deterministic=True)), ReferenceAdapter)  # auto on the CPU
    monkeypatch.setattr(type(model), "device", property(lambda _: torch.device("cuda")))
    with pytest.raises(ValueError) as refused:  # transformers' modules run fla's autotuned kernels on a GPU
        create_engine(model, Settings(deterministic=True, engine="reference"))
    assert "--deterministic (DQ_DETERMINISTIC)" in str(refused.value) and "--engine fast" in str(refused.value)
    for fields in (dict(cuda_graphs=False), dict(compile="none")):  # eager packs run kernels of their own length
        with pytest.raises(ValueError, match="--cuda-graphs, --compile layer"):
            FastEngine(model, Settings(deterministic=True, **fields), mixers=TorchMixers())


def test_unset_it_is_on_where_its_kernels_run_and_the_worker_says_why_where_it_is_not(loaded, monkeypatch, caplog):
    model = loaded("repo")
    with caplog.at_level(logging.INFO, logger="worker"):
        engine = create_engine(model, Settings())
    assert isinstance(engine, ReferenceAdapter) and engine.deterministic is False
    assert "deterministic mode off by default: on the CPU it scores each prompt alone" in caplog.text
    assert create_engine(model, Settings(deterministic=True)).deterministic is True  # asked for: on
    # as the fast engine on a GPU asks it (worker/fast/engine.py), the card's and model's answers stood in
    monkeypatch.setattr(type(model), "device", property(lambda _: torch.device("cuda")))
    monkeypatch.setattr(type(model), "dtype", property(lambda _: torch.bfloat16))
    config = model.text_config
    assert "linear_attention" in config.layer_types
    monkeypatch.setattr(config, "linear_key_head_dim", 64)
    assert deterministic.by_default(model, Settings()) == (False, (
        "it runs the delta rule on FlashQLA, which takes bf16 or fp16 and 128-wide heads; this model is "
        f"torch.bfloat16 with 64- and {config.linear_value_head_dim}-wide heads"))
    monkeypatch.setattr(config, "linear_key_head_dim", 128)
    monkeypatch.setattr(config, "linear_value_head_dim", 128)
    monkeypatch.setattr(FlashQLA, "missing", staticmethod(lambda: "ValueError: no kernels for sm_80"))
    on, why = deterministic.by_default(model, Settings())
    assert not on and "FlashQLA" in why and "no kernels for sm_80" in why
    monkeypatch.setattr(FlashQLA, "missing", staticmethod(lambda: None))
    assert deterministic.by_default(model, Settings()) == (True, "its kernels run here (--no-deterministic "
                                                                 "turns it off)")
    assert deterministic.by_default(model, Settings(compile="none"))[0] is False
    assert deterministic.by_default(model, Settings(engine="reference"))[0] is False
    assert deterministic.decide(model, Settings(deterministic=False)) is False  # --no-deterministic: off


def test_enable_sets_cublas_without_split_k_and_inductor_without_timing_before_the_first_matmul():
    code = ("import os, torch, torch._inductor.config as inductor\n"
            "from worker.fast import deterministic\n"
            "deterministic.enable()\n"
            "print(os.environ['CUBLASLT_WORKSPACE_SIZE'], os.environ['CUBLAS_WORKSPACE_CONFIG'], "
            "inductor.deterministic, torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction, "
            "getattr(torch.backends.cuda.matmul, 'allow_bf16_reduced_precision_reduction_split_k', False), "
            "inductor.split_reductions, inductor.triton.mix_order_reduction, inductor.max_autotune)\n")
    # the last three: Inductor's splits sized by the card's multiprocessor count, off
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, "TORCHINDUCTOR_MAX_AUTOTUNE": "1"})
    assert out.stdout.split() == ["1", ":16:8", "True", "False", "False", "False", "False", "False"]


def test_a_gemm_that_depends_on_the_batch_stops_the_start(monkeypatch):
    """deterministic.check_gemms, run by the fast engine's warm-up in deterministic mode: rows at other places and
    counts must come out bitwise as at the largest count. A GEMM whose sums change with M (as split-K does) is
    refused by name."""
    weight = ops.Dense(torch.randn(48, 32))
    assert deterministic.check_gemms([weight, weight], [16, 64, 256], torch.float32) == 1

    def split_by_rows(inputs, weights):  # another order of the same sums when the batch is small
        out = torch.nn.functional.linear(inputs, weights.weight)
        return out if inputs.shape[0] >= 256 else out + out.abs() * 1e-6

    monkeypatch.setattr(deterministic.ops, "linear", split_by_rows)
    with pytest.raises(deterministic.NotDeterministic, match="48 x 32 Dense GEMM gives other bits at 16 rows"):
        deterministic.check_gemms([weight], [16, 64, 256], torch.float32)
