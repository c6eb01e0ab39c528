"""FP8 weights on the CPU (worker/fast/fp8.py): rowwise quantization and its matmul, the linear layers' bf16 gate
rows kept apart, and the layers and families of matrices a setting converts."""

import pytest
import torch
import torch.nn.functional as F

from worker.fast import fp8, layers, ops
from worker.fast.forward import PackedForward
from worker.fast.layers import FULL, LINEAR
from worker.fast.mixers import TorchMixers
from worker.fast_options import chosen_families


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


def test_fp8_quantization_is_rowwise_and_slices_consistently():
    torch.manual_seed(0)
    dense = ops.Dense(torch.randn(48, 32) * torch.logspace(-2, 2, 48)[:, None])
    quantized = fp8.quantize(dense)
    assert quantized.qweight.dtype == torch.float8_e4m3fn and quantized.scale.shape == (1, 48)
    restored = quantized.qweight.float() * quantized.scale.t()
    assert ((restored - dense.weight).abs() <= dense.weight.abs().amax(1, keepdim=True) / 16).all()
    part = fp8.rows(quantized, 16, 32)
    alone = fp8.quantize(ops.Dense(dense.weight[16:32]))
    assert torch.equal(part.qweight.float(), alone.qweight.float()) and torch.equal(part.scale, alone.scale)
    assert not fp8.eligible(ops.Dense(torch.randn(40, 24)))


def test_fp8_linear_is_the_dequantized_matmul():
    """Rowwise FP8: each token scaled by its own amax, each output channel by the weight's; fp32 accumulation."""
    torch.manual_seed(0)
    weight = torch.randn(48, 64) * torch.logspace(-2, 1, 48)[:, None]
    w = fp8.quantize(ops.Dense(weight.to(torch.bfloat16), torch.randn(48).to(torch.bfloat16)))
    x = (torch.randn(2, 5, 64) * torch.logspace(-3, 2, 5)[None, :, None]).to(torch.bfloat16)
    flat = x.reshape(-1, 64).float()
    scale = flat.abs().amax(-1, keepdim=True) / ops.FP8_MAX
    xq = (flat / scale).to(torch.float8_e4m3fn).float() * scale
    expected = xq @ (w.qweight.float() * w.scale.t()).t() + w.bias.float()
    got = ops.fp8_linear(x, w)
    assert got.shape == (2, 5, 48) and got.dtype == torch.bfloat16
    assert torch.allclose(got.reshape(-1, 48).float(), expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()))
    # and close to the bf16 matmul it stands for (3 mantissa bits: a few percent of each row's scale)
    exact = F.linear(x.float(), weight, w.bias.float()).reshape(-1, 48)
    assert ((got.reshape(-1, 48).float() - exact).abs().amax(1) <= 0.1 * exact.abs().amax(1)).all()


def test_fp8_converts_every_eligible_matrix(loaded):
    model = loaded("repo")
    layer = next(layer for layer in model.language_model.layers if layer.block_type == "full_attention")
    weights, _ = layers.full_layer(layer)
    converted = fp8.convert(weights)
    assert isinstance(converted.qkv, ops.Fp8) and isinstance(converted.mlp.down, ops.Fp8)
    assert converted.q.qweight.data_ptr() == converted.qkv.qweight.data_ptr()  # a view, not a copy
    assert fp8.count(converted) == 6  # qkv (and its q and kv row views), o_proj, the MLP's gate_up and down


def test_fp8_matrices_picks_the_families(loaded):
    model = loaded("repo")
    full = layers.full_layer(next(x for x in model.language_model.layers if x.block_type == "full_attention"))[0]
    linear = layers.linear_layer(next(x for x in model.language_model.layers if x.block_type != "full_attention"))[0]
    mlp = chosen_families("mlp")
    assert fp8.count(fp8.convert(full, mlp)) == 2 and isinstance(fp8.convert(full, mlp).qkv, ops.Dense)
    converted = fp8.convert(linear, mlp)
    assert fp8.count(converted) == 2 and converted.in_proj is linear.in_proj and converted.gates is None
    attention = fp8.convert(full, chosen_families("attention,linear"))
    assert isinstance(attention.o_proj, ops.Fp8) and isinstance(attention.mlp.down, ops.Dense)
