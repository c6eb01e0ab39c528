"""The fast path's own Triton kernels (worker/fast/fused.py) against their unfused PyTorch forms, in bf16 and FP8,
alone and inside a compiled piece replayed as a CUDA graph (the kernels write the static buffers in place).

FP8 outputs are held to FP8's own rounding: every value within half a step of the exact (fp32) value and the same
code as quantising that value in PyTorch, scales equal to fp32 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from worker.fast import fp8, fused, layers, ops
from worker.fast.forward import compile_piece
from worker.fast.graphs import post_linear_into, pre_linear_into

bf16 = torch.bfloat16
EPS = 1e-6


def randn(*shape: int, scale: float = 1.0, dtype: torch.dtype = bf16) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def check_fp8(values: torch.Tensor, scale: torch.Tensor, exact: torch.Tensor) -> None:
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (exact.shape[0], 1)
    restored = values.float() * scale
    reference = ops.quantize(exact)
    step = torch.maximum(exact.abs() * 2 ** -3, scale * 2 ** -9)  # e4m3: 3 mantissa bits, subnormals at 2^-9
    outside = ((restored - exact).abs() > 0.51 * step).float().mean().item()
    same = (values.view(torch.uint8) == reference.values.view(torch.uint8)).float().mean().item()
    assert torch.isfinite(restored).all() and outside < 1e-3 and same > 0.99, (outside, same)
    assert torch.allclose(scale, reference.scale, rtol=1e-5, atol=0)


@pytest.mark.parametrize("tokens,inner", [(64, 384), (40, 6144)])
def test_swiglu_quant(tokens, inner):
    x = randn(tokens, 2 * inner)
    values, scale = fused.swiglu_quant(x)
    gate, up = x.float().chunk(2, dim=-1)
    check_fp8(values, scale, F.silu(gate) * up)


@pytest.mark.parametrize("heads", [4, 16])
def test_gated_rms_norm_quant(heads, tokens=64, dim=128):
    o = randn(tokens, heads, dim)
    z = randn(tokens, heads * dim + 40)[:, 8: 8 + heads * dim]  # strided: a view of the in-projection
    weight = (1 + 0.1 * torch.randn(dim, device="cuda")).to(bf16)
    values, scale = fused.gated_rms_norm_quant(o, z, weight, EPS)
    normed = (o.float() * torch.rsqrt(o.float().pow(2).mean(-1, keepdim=True) + EPS)).to(bf16)
    check_fp8(values, scale, ((weight * normed).float() * F.silu(z.float().view(o.shape))).reshape(tokens, -1))


def _dims(k_heads: int, v_heads: int, dim: int = 128) -> layers.LinearDims:
    return layers.LinearDims(k_heads * dim, v_heads * dim, k_heads, v_heads, dim, dim, EPS)


@pytest.mark.parametrize("lengths,k_heads,v_heads,apart", [
    ((5, 70, 1, 33, 19), 2, 4, False), ((5, 70, 1, 33, 19), 2, 4, True),
    ((700, 1, 2, 3, 512, 256, 4000), 16, 16, False), ((300, 300), 16, 32, False)])
def test_short_conv_equals_the_unfused_ops(lengths, k_heads, v_heads, apart):
    d = _dims(k_heads, v_heads)
    tokens = sum(lengths)
    width = 2 * d.key_dim + 2 * d.value_dim + (0 if apart else 2 * v_heads) + 24
    x = randn(tokens, width)
    gates = randn(tokens, 2 * v_heads + 3) if apart else x
    off_z = 2 * d.key_dim + d.value_dim
    off_b = 0 if apart else off_z + d.value_dim
    args = (x, gates, (off_z, off_b, off_b + v_heads), randn(2 * d.key_dim + d.value_dim, 4),
            torch.randn(v_heads, device="cuda"), randn(v_heads), d,
            torch.cat([torch.arange(n) for n in lengths]).cuda())
    expected = ops.short_conv(*args)
    outs = [torch.full_like(t, float("nan")) for t in expected]
    assert fused.short_conv(*args, outs) is outs
    for name, got, want in zip(("q", "k", "v", "g", "beta", "z"), outs, expected):
        bound = 2 ** -7 * want.float().abs().max().item() + 1e-5  # one bf16 rounding apart at most
        assert torch.isfinite(got).all() and (got.float() - want.float()).abs().max().item() <= bound, name


def _linear_weights(d: layers.LinearDims, hidden: int) -> layers.LinearAttn:
    rows = 2 * d.key_dim + 2 * d.value_dim + 2 * d.v_heads
    mlp = layers.Mlp(randn(hidden, scale=0.1), ops.Dense(randn(2 * 512, hidden, scale=0.03)),
                     ops.Dense(randn(hidden, 512, scale=0.03)))
    return layers.LinearAttn(randn(hidden, scale=0.1), ops.Dense(randn(rows, hidden, scale=0.03)),
                             randn(2 * d.key_dim + d.value_dim, 4, scale=0.3), torch.randn(d.v_heads, device="cuda"),
                             randn(d.v_heads), 1 + randn(d.head_v, scale=0.1), ops.Dense(randn(hidden, d.value_dim,
                                                                                               scale=0.03)), mlp)


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "fp8"])
@torch.inference_mode()
def test_compiled_graphed_pieces_with_fused_kernels_equal_the_plain_ones(quantized, tokens=256, hidden=512):
    """pre_linear_into and post_linear_into, compiled with static shapes and captured as CUDA graphs over static
    buffers, with the fused kernels, against the plain ops run eagerly."""
    d = _dims(2, 4)
    w = _linear_weights(d, hidden)
    if quantized:
        w = fp8.convert(w)
        assert isinstance(w.in_proj, ops.Fp8) and w.gates is not None
    plain, fast = ops.Ops(), fused.fused_ops(ops.Ops())
    seqpos = torch.cat([torch.arange(n) for n in (100, 156)]).cuda()
    h = randn(tokens, hidden)
    outs = [torch.zeros(tokens, 2, 128, device="cuda", dtype=bf16), torch.zeros(tokens, 2, 128, device="cuda",
                                                                                 dtype=bf16),
            torch.zeros(tokens, 4, 128, device="cuda", dtype=bf16), torch.zeros(tokens, 4, device="cuda"),
            torch.zeros(tokens, 4, device="cuda", dtype=bf16), torch.zeros(tokens, d.value_dim, device="cuda",
                                                                            dtype=bf16)]
    o = randn(tokens, 4, 128)
    pre = compile_piece(pre_linear_into, inline=True, dynamic=False)
    post = compile_piece(post_linear_into, dynamic=False)
    state = h.clone()

    def piece() -> None:
        pre(fast, d, w, state, seqpos, *outs)
        post(fast, d, w, state, o, outs[5])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        piece()  # compilation, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        piece()
    for buffer in outs:
        buffer.zero_()
    state.copy_(h)
    graph.replay()
    torch.cuda.synchronize()
    expected = list(layers.pre_linear(plain, d, w, h, seqpos))
    after = layers.post_linear(plain, d, w, h, o, expected[5])
    # Compiled, Inductor quantises the norm's fp32 result where the eager form rounds it to bf16 first: single FP8
    # codes of the projections' input move by a step, so FP8 outputs agree to FP8's rounding, bf16 ones to bf16's.
    step = 2 ** -4 if quantized else 2 ** -7
    for name, got, want in zip(("q", "k", "v", "g", "beta", "z"), outs, expected):
        assert (got.float() - want.float()).abs().max() <= step * want.float().abs().max() + 1e-5, name
    error = ((state.float() - after.float()).norm() / (after.float() - h.float()).norm()).item()
    assert error < (0.06 if quantized else 0.03), error  # the residual update, through three GEMMs
