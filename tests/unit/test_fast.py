"""The fast engine on the CPU (worker/fast; FP8 apart: test_fp8.py): pack layout, the boundary-respecting
convolution, the layer ops against transformers' modules, and the whole packed forward (with plain-torch mixers
standing in for fla and FlashAttention, and plain calls standing in for CUDA graphs) against the padded reference
engine; the engine's buffers, and the compile-cache setting."""

import os

import numpy as np
import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

from producer.wire.schema import Request
from support import png
from worker.config import Settings
from worker.fast import FastEngine, FastPathUnavailable, layers, ops
from worker.fast.layers import LINEAR
from worker.fast.layout import GDN_CHUNK, Layout, Regions, choose_bucket, gdn_chunk_indices, lay_out, prompt_positions
from worker.fast.mixers import TorchMixers
from worker.fast.warmup import CACHES, use_compile_cache
from worker.model.encoder import Encoder
from worker.model.engine import TOKENS_PER_ROW, Prompt
from worker.model.readout import head
from worker.model.reference import ReferenceEngine

MIXED = {
    "spam": {"type": "noul", "instructions": "Is this spam?"},
    "tone": {"type": "choice", "criteria": {"calm": "polite", "angry": None, "pushy": "pressure"}},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high", "now"]},
}
PLAIN_CAPTURE = (lambda piece: piece, lambda piece: piece())  # "graphs" that just call the piece
SMALL = dict(pack_tokens=1024, max_prompt_tokens=1024, compile="none")


def prompts_of(model, with_images=True, max_tokens=None):
    encoder = Encoder(model)
    requests = [Request.model_validate({"state": "I was charged twice. " * k, "questions": MIXED}) for k in (1, 5)]
    requests.append(Request.model_validate({"state": {"message": "WIN a FREE phone"},
                                            "questions": {"spam": MIXED["spam"]}}))
    if with_images and model.multimodal:
        requests.append(Request.model_validate({
            "state": "Look: img-1, then img-2.", "questions": MIXED,
            "assets": {"img-1": {"data_base64": png("red", (64, 64))},
                       "img-2": {"data_base64": png("blue", (96, 32))}}}))
    return [prompt for request in requests for prompt in encoder.prompts(request)]


def assert_scores_close(got, expected, atol=1e-4):
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.shape == b.shape and a.dtype == torch.float32
        assert torch.allclose(a, b, atol=atol), (a - b).abs().max()


# ---- layout ----

def test_choose_bucket():
    assert choose_bucket(1, (2048, 512, 1024)) == 512
    assert choose_bucket(512, (512, 1024)) == 512
    assert choose_bucket(513, (512, 1024)) == 1024
    assert choose_bucket(1025, (512, 1024)) is None
    assert choose_bucket(10, ()) is None


def _prompt(length, questions=1):
    rows = torch.arange(questions) + length - questions
    return Prompt(input_ids=torch.arange(length) % 50, rows=rows, questions=(None,) * questions)


def test_plan_picks_the_smallest_bucket_and_falls_back_to_eager():
    layout = lay_out([_prompt(100), _prompt(60, 3)], (128, 256))
    assert (layout.bucket, layout.capacity, layout.tokens, layout.rows) == (256, 256, 160, 4)
    assert layout.cu_seqlens == [0, 100, 160] and layout.cu_rows == [0, 1, 4] and layout.max_length == 100
    eager = lay_out([_prompt(300)], (128, 256))  # longer than the largest bucket: runs alone, eagerly
    assert (eager.bucket, eager.capacity) == (None, 300)
    crowded = lay_out([_prompt(2, 1) for _ in range(70)], (256,))  # more marker rows than the bucket's graphs hold
    assert crowded.bucket is None and crowded.capacity == 140
    assert lay_out([_prompt(5)], ()).bucket is None


def test_a_pack_with_more_questions_than_its_bucket_has_rows_goes_to_a_larger_bucket():
    # 600 tokens fit 1024, whose graphs compute 128 marker rows; 200 questions need 2048's 256
    many = lay_out([_prompt(300, 100), _prompt(300, 100)], (512, 1024, 2048, 4096))
    assert (many.bucket, many.rows_capacity, many.rows) == (2048, 256, 200)
    # the packer charges such prompts by their questions, so a pack it makes always finds a bucket
    prompts = [_prompt(300, 100)] * 5
    assert sum(p.room for p in prompts) == 4000 and lay_out(prompts, (512, 1024, 2048, 4096)).bucket == 4096
    assert _prompt(300, 10).room == 300 and _prompt(300, 100).room == 100 * TOKENS_PER_ROW


def test_gdn_chunk_indices_match_the_chunking():
    index = gdn_chunk_indices([1, GDN_CHUNK, GDN_CHUNK + 1, 3 * GDN_CHUNK])
    assert index.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [3, 0], [3, 1], [3, 2]]
    assert Layout((1, 64, 65, 192), (1, 1, 1, 1), 322, 4, None).gdn_chunks == len(index)


def test_regions_fill_writes_the_pack_and_resets_tails():
    regions = Regions.for_capacity(64)
    assert all(getattr(regions, name) % 64 == 0 for name in ("ids", "positions", "seqpos", "rows", "cu"))
    buffer = np.full(regions.size, 7, dtype=np.int64)
    prompts = [_prompt(5, 2), _prompt(3, 1)]
    layout = Layout((5, 3), (2, 1), 16, 4, 16)
    positions = [prompt_positions(prompt, None) for prompt in prompts]
    regions.fill(buffer, layout, prompts, positions, pad_id=99)
    ids = buffer[regions.ids: regions.ids + 16]
    assert ids[:8].tolist() == [0, 1, 2, 3, 4, 0, 1, 2] and (ids[8:] == 99).all()
    seqpos = buffer[regions.seqpos: regions.seqpos + 16]
    assert seqpos.tolist() == [0, 1, 2, 3, 4, 0, 1, 2] + [0] * 8
    pos = buffer[regions.positions: regions.positions + 3 * 64].reshape(3, 64)[:, :16]
    assert (pos == seqpos).all()  # text: the three M-RoPE axes are the position in the prompt
    assert buffer[regions.rows: regions.rows + 4].tolist() == [3, 4, 7, 0]
    assert buffer[regions.cu: regions.cu + 3].tolist() == [0, 5, 8]
    assert buffer[regions.cu_rows: regions.cu_rows + 3].tolist() == [0, 2, 3]
    assert buffer[regions.chunk_index: regions.chunk_index + 4].tolist() == [0, 0, 1, 0]


def test_image_positions_are_the_backbones_rope_index(loaded):
    model = loaded("repo")
    prompt = next(c for c in prompts_of(model) if c.has_images)
    got = prompt_positions(prompt, model.backbone.get_rope_index)
    expected, _ = model.backbone.get_rope_index(prompt.input_ids[None], prompt.mm_token_type_ids[None],
                                                image_grid_thw=prompt.image_grid_thw)
    assert np.array_equal(got, expected[:, 0].numpy()) and got[:, 0].tolist() == [0, 0, 0]
    assert not np.array_equal(got[0], got[1])  # images do get 2-D positions


# ---- ops against transformers' modules ----

def test_conv_never_reads_across_prompt_boundaries():
    torch.manual_seed(0)
    lengths, channels = [5, 1, 9, 3], 6
    x, weight = torch.randn(sum(lengths), channels), torch.randn(channels, 4)
    seqpos = torch.cat([torch.arange(n) for n in lengths])
    got = ops.conv_silu(x, weight, seqpos)
    start = 0
    for n in lengths:  # transformers' convolution on each prompt alone, (1, channels, length) layout
        alone = qwen.causal_conv1d_fn(x[start: start + n].T[None], weight, None, activation="silu")[0].T
        assert torch.allclose(got[start: start + n], alone, atol=1e-6)
        start += n


def test_ops_match_the_modules_bit_for_bit_in_bf16():
    torch.manual_seed(0)
    x, gate = torch.randn(7, 3, 32, dtype=torch.bfloat16), torch.randn(7, 3, 32, dtype=torch.bfloat16)
    norm = qwen.Qwen3_5RMSNorm(32, eps=1e-6).to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    assert torch.equal(ops.rms_norm(x, norm.weight, norm.eps), norm(x))
    gated = qwen.Qwen3_5RMSNormGated(32, eps=1e-6).to(torch.bfloat16)
    torch.nn.init.normal_(gated.weight)
    assert torch.equal(ops.gated_rms_norm(x, gate, gated.weight, 1e-6), gated(x, gate))
    cos, sin = torch.randn(7, 8, dtype=torch.bfloat16), torch.randn(7, 8, dtype=torch.bfloat16)
    expected, _ = qwen.apply_rotary_pos_emb(x, x, cos, sin, unsqueeze_dim=1)
    assert torch.equal(ops.rope(x, cos, sin), expected)


def test_head_and_gates_match(loaded):
    model = loaded("repo")
    hidden = torch.randn(5, model.model.proj.in_features)
    w = ops.Dense(model.model.proj.weight, model.model.proj.bias)
    assert torch.equal(ops.softcap_head(hidden, w, model.softcap), head(model, hidden))
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    a_log, dt_bias = torch.randn(3), torch.randn(3)
    g, beta = ops.gdn_gates(a, b, a_log, dt_bias)
    assert torch.equal(g, -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias))
    assert torch.equal(beta, b.sigmoid())


# ---- the packed forward against the reference engine ----

@pytest.mark.parametrize("name", ["repo", "repo-text", "judge"])
@pytest.mark.parametrize("prune_last", [False, True])
def test_packed_forward_equals_the_reference(loaded, name, prune_last):
    model = loaded(name)
    prompts = prompts_of(model)
    engine = FastEngine(model, Settings(cuda_graphs=False, prune_last=prune_last, **SMALL), mixers=TorchMixers())
    assert engine.fwd.pruned == (prune_last and name != "judge")  # the causal JEV checkpoint is never pruned
    run = engine.launch(prompts).wait()
    assert (run.tokens, run.capacity, run.bucket, run.graph) == (sum(c.length for c in prompts), run.tokens, None,
                                                                 False)
    assert_scores_close(run.scores, ReferenceEngine(model).forward(prompts))


@pytest.mark.parametrize("prune_last", [False, True])
def test_bucketed_path_with_static_buffers_equals_the_reference(loaded, prune_last):
    model = loaded("repo", 140)  # requests split over several prompts
    prompts = prompts_of(model)
    settings = Settings(cuda_graphs=True, buckets="256,512,1024", prune_last=prune_last, **SMALL)
    engine = FastEngine(model, settings, mixers=TorchMixers(), capture=PLAIN_CAPTURE)
    engine.warmup()
    assert engine.max_pack_tokens == 1024
    reference = ReferenceEngine(model).forward(prompts)
    # several compositions and buckets, launched before any is waited for (the staging slots rotate)
    packs = [list(range(len(prompts))), [0], [2, 1], list(range(len(prompts)))[::-1], [len(prompts) - 1]]
    pending = [(pack, engine.launch([prompts[i] for i in pack])) for pack in packs]
    for pack, run in pending:
        result = run.wait()
        assert result.graph and result.bucket == choose_bucket(result.tokens, (256, 512, 1024))
        assert result.capacity == result.bucket
        assert_scores_close(result.scores, [reference[i] for i in pack])


@pytest.mark.parametrize("graphs, pack_tokens, buckets, budget", [
    (True, 512, (256, 512), 512), (True, 700, (256, 512, 700), 700), (True, 2048, (256, 512, 1024, 2048), 2048),
    (False, 700, (), 700)])
def test_the_engines_budget_is_pack_tokens_with_graphs_or_without(loaded, graphs, pack_tokens, buckets, budget):
    """The packer fills packs to the engine's budget (the daemon passes max_pack_tokens): --pack-tokens, and with
    graphs the largest bucket too, whatever --buckets lists above it."""
    settings = Settings(cuda_graphs=graphs, buckets="256,512,1024", **{**SMALL, "pack_tokens": pack_tokens})
    engine = FastEngine(loaded("repo"), settings, mixers=TorchMixers(), capture=PLAIN_CAPTURE)
    assert (engine.buckets, engine.max_pack_tokens) == (buckets, budget)


def test_a_prompt_longer_than_every_bucket_runs_eagerly(loaded):
    model = loaded("repo")
    prompt = max(prompts_of(model), key=lambda c: c.length)
    settings = Settings(cuda_graphs=True, buckets="64,128", **{**SMALL, "pack_tokens": 128})
    engine = FastEngine(model, settings, mixers=TorchMixers(),
                        capture=PLAIN_CAPTURE)
    engine.warmup()
    assert prompt.length > engine.max_pack_tokens
    run = engine.launch([prompt]).wait()
    assert (run.bucket, run.graph, run.capacity) == (None, False, prompt.length)
    assert_scores_close(run.scores, ReferenceEngine(model).forward([prompt]))


def test_fast_engine_without_cuda_names_the_reference_engine(loaded):
    with pytest.raises(FastPathUnavailable, match="reference"):
        FastEngine(loaded("repo"), Settings())


def test_unknown_compile_mode_is_refused(loaded):
    with pytest.raises(ValueError, match="compile"):
        FastEngine(loaded("repo"), Settings(compile="everything"), mixers=TorchMixers())


def test_without_flash_linear_attention_the_error_names_the_reference_engine(monkeypatch):
    import sys

    from worker.fast.mixers import _chunk_gated_delta_rule

    monkeypatch.setitem(sys.modules, "fla", None)
    monkeypatch.setitem(sys.modules, "fla.ops", None)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)
    with pytest.raises(FastPathUnavailable, match="flash-linear-attention.*reference"):
        _chunk_gated_delta_rule()


def test_a_variant_child_that_fails_is_logged_and_the_warm_up_goes_on(caplog):
    """worker/fast/prebuild.py: a child compiling a delta-rule variant beside the capture that fails costs only the
    time it would have saved (the warm-up pack compiles the variant itself): join returns and logs which one."""
    import logging

    from worker.fast import prebuild

    children = prebuild.start({"unsplit, tile 32": [64]}, 16, 16, 128, 128, dtype="no_such_dtype")
    with caplog.at_level(logging.INFO):
        children.join(logging.getLogger("warm-up"), timeout=120)
    failed = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(failed) == 1 and "unsplit, tile 32" in failed[0] and "exit 1" in failed[0], failed
    assert "no_such_dtype" in failed[0]  # the child's last line: its error


# ---- buffers and settings of the engine ----

def _linear_layer(model):
    layer = next(layer for layer in model.language_model.layers if layer.block_type == LINEAR)
    return layers.linear_layer(layer)


def test_short_conv_writes_into_given_buffers(loaded):
    weights, d = _linear_layer(loaded("repo"))
    lengths = [5, 9, 1]
    seqpos = torch.cat([torch.arange(n) for n in lengths])
    x = torch.randn(sum(lengths), weights.in_proj.weight.shape[0])
    off_z = 2 * d.key_dim + d.value_dim
    offsets = (off_z, off_z + d.value_dim, off_z + d.value_dim + d.v_heads)
    fresh = ops.short_conv(x, x, offsets, weights.conv.float(), weights.a_log, weights.dt_bias, d, seqpos)
    outs = [torch.full_like(t, float("nan")) for t in fresh]
    assert ops.short_conv(x, x, offsets, weights.conv.float(), weights.a_log, weights.dt_bias, d, seqpos,
                          outs) is outs
    for got, want in zip(outs, fresh):
        assert torch.equal(got, want)


def test_bucket_tails_are_zeroed_for_every_pack(loaded):
    """The mixers write the real rows only: what an earlier, longer pack left past them is cleared."""
    model = loaded("repo")
    question = Encoder(model).prompts(Request.model_validate({"state": "hi", "questions": {
        "spam": {"type": "noul"}}}))[0].questions
    long, short = (Prompt(input_ids=torch.arange(n) % 50 + 3, rows=torch.tensor([n - 1]), questions=question)
                   for n in (200, 40))
    settings = Settings(cuda_graphs=True, buckets="256", pack_tokens=256, max_prompt_tokens=256, compile="none",
                        prune_last=False)  # the full layers write fo for every row
    engine = FastEngine(model, settings, mixers=TorchMixers(), capture=PLAIN_CAPTURE)
    engine.warmup()
    engine.launch([long]).wait()
    ws = engine.graphed.ws
    assert ws.lo[40:200].abs().sum() > 0 and ws.fo[40:200].abs().sum() > 0  # the long pack's real rows
    engine.launch([short]).wait()
    assert ws.lo[40:256].abs().sum() == 0 and ws.fo[40:256].abs().sum() == 0


def test_compile_cache_puts_every_compiler_under_one_directory(tmp_path, monkeypatch):
    for variable in CACHES:
        monkeypatch.delenv(variable, raising=False)
    use_compile_cache(str(tmp_path / "cache"))
    for variable, name in CACHES.items():
        assert os.environ[variable] == str(tmp_path / "cache" / name) and os.path.isdir(os.environ[variable])
    assert Settings.from_env({"DQ_COMPILE_CACHE": "/var/cache/dq"}).compile_cache == "/var/cache/dq"
