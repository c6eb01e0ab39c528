"""The fast path's options on the CPU: FP8's bf16 gate rows and per-layer choice, pre-quantised activations, the
short convolution's in-place form, inert bucket tails, and the compile-cache setting."""

import os

import pytest
import torch

from producer.wire.schema import Request
from worker.config import Settings
from worker.fast import FastEngine, fp8, layers, ops
from worker.fast.warmup import CACHES, use_compile_cache
from worker.fast.forward import PackedForward
from worker.fast.layers import FULL, LINEAR
from worker.fast.mixers import TorchMixers
from worker.model.encoder import Encoder
from worker.model.engine import Prompt

PLAIN_CAPTURE = (lambda piece: piece, lambda piece: piece())


def _linear_layer(model):
    layer = next(layer for layer in model.language_model.layers if layer.block_type == LINEAR)
    return layers.linear_layer(layer)


def test_fp8_keeps_the_gate_rows_in_bf16_apart(loaded):
    model = loaded("repo")
    weights, dims = _linear_layer(model)
    weights = weights._replace(in_proj=ops.Dense(torch.randn(2 * dims.key_dim + 2 * dims.value_dim + 32,
                                                             weights.in_proj.weight.shape[1])),
                               a_log=torch.zeros(16))  # 16 value heads: the b and a rows are the last 32
    converted = fp8.convert(weights)
    assert isinstance(converted.in_proj, ops.Fp8) and isinstance(converted.gates, ops.Dense)
    assert converted.in_proj.qweight.shape[0] == 2 * dims.key_dim + 2 * dims.value_dim
    assert torch.equal(converted.gates.weight, weights.in_proj.weight[-32:])
    assert fp8.count(converted) == 4  # in_proj, out_proj, gate_up, down; the gates stay bf16


def test_fp8_leaves_a_projection_whose_rows_do_not_tile_whole(loaded):
    weights, _ = _linear_layer(loaded("repo"))
    weights = weights._replace(in_proj=ops.Dense(torch.randn(40 + 4, 64)), a_log=torch.zeros(2))  # 40: not 16k
    converted = fp8.convert(weights)
    assert converted.in_proj is weights.in_proj and converted.gates is None  # gates never quantised
    assert isinstance(converted.mlp.down, ops.Fp8)


def test_fp8_layers_names_layers_by_kind_or_index():
    kinds = [LINEAR, LINEAR, LINEAR, FULL] * 2
    assert fp8.chosen_layers("all", kinds) == set(range(8))
    assert fp8.chosen_layers("full", kinds) == {3, 7}
    assert fp8.chosen_layers("Linear", kinds) == {0, 1, 2, 4, 5, 6}
    assert fp8.chosen_layers("late", kinds) == {4, 5, 6, 7}  # the second half, the least sensitive
    assert fp8.chosen_layers("0-2, 7", kinds) == {0, 1, 2, 7}
    for bad in ("8", "x", "3-", ""):
        with pytest.raises(ValueError, match="fp8_layers"):
            fp8.chosen_layers(bad, kinds)


def test_only_the_chosen_layers_are_converted(loaded):
    model = loaded("repo")
    kinds = [layer.block_type for layer in model.language_model.layers]
    fwd = PackedForward(model, TorchMixers(), fp8=True, fp8_layers="full", prune_last=False)
    converted = [i for i, stage in enumerate(fwd.stages) if fp8.count(stage.weights)]
    assert converted == [i for i, kind in enumerate(kinds) if kind == FULL] and fwd.fp8_matrices > 0


def test_a_quantized_activation_gives_the_same_product():
    torch.manual_seed(0)
    w = fp8.quantize(ops.Dense(torch.randn(48, 64).to(torch.bfloat16)))
    x = torch.randn(7, 64).to(torch.bfloat16)
    q = ops.quantize(x)
    assert q.values.dtype == torch.float8_e4m3fn and q.scale.shape == (7, 1) and q.dtype == torch.bfloat16
    assert torch.equal(ops.linear(q, w), ops.linear(x, w))
    with pytest.raises(AssertionError, match="FP8"):
        ops.linear(q, ops.Dense(torch.randn(48, 64).to(torch.bfloat16)))


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
