"""The fast path's own Triton kernels, where one pass over each row beats what Inductor makes of the same ops
(micro-benchmarks per 16k-token 2B pack on an H200 in docs/BENCHMARKS.md):

- ``short_conv_``: a linear layer's depthwise causal convolution + SiLU + q/k L2 norm, read strided from the
  in-projection's output and written in place into the static buffers, with the decay and write-strength gates
  and the copy of z (0.47 -> 0.21 ms per layer, bf16 and FP8).
- ``swiglu_quant``: SwiGLU + FP8 quantisation of the down projection's input (0.28 -> 0.15 ms per layer).
- ``gated_rms_norm_quant``: the per-head gated RMSNorm + FP8 quantisation of out_proj's input (0.18 -> 0.09
  ms).

A residual add + RMSNorm (+ quantisation) kernel measured no faster than Inductor's (0.085 against 0.082 ms)
and is not used. Each kernel is a torch custom op, so that compiled pieces call it as one opaque kernel and
CUDA graphs capture it. Quantisation is rowwise as ``ops.quantize``: one fp32 scale per token (amax / 448),
values rounded to nearest, computed from the fp32 result rather than a bf16 rounding of it. ``fused_ops``
swaps them into ``Ops`` where they apply (bf16 or fp16 activations; power-of-two head sizes) and leaves the
plain functions elsewhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import triton
import triton.language as tl

from . import ops as plain
from .ops import Fp8, Linear, Ops, Quantized

HALF = (torch.bfloat16, torch.float16)


@triton.jit
def _quantize_row(y, mask, q_ptr, s_ptr, row, cols):
    """Store ``y`` (fp32, masked entries ignored) as FP8 with its rowwise scale."""
    amax = tl.max(tl.where(mask, tl.abs(y), 0.0))
    scale = tl.maximum(amax, 1e-12) / 448.0
    q = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
    tl.store(q_ptr + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row, scale)


@triton.jit
def _swiglu_quant_kernel(x_ptr, q_ptr, s_ptr, stride_x, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    _quantize_row(y, mask, q_ptr + row * I, s_ptr, row, cols)


@triton.jit
def _gated_rms_norm_quant_kernel(o_ptr, z_ptr, w_ptr, q_ptr, s_ptr, stride_o, stride_z, eps,
                                 H: tl.constexpr, D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, H)[:, None]
    dims = tl.arange(0, D)[None, :]
    cols = heads * D + dims
    o = tl.load(o_ptr + row * stride_o + cols).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(o * o, axis=1) / D + eps)
    # As Qwen3_5RMSNormGated: normalised value and weight product rounded to the input dtype, gate in fp32.
    normed = (o * rstd[:, None]).to(o_ptr.dtype.element_ty)
    weight = tl.load(w_ptr + dims)
    scaled = (weight.to(tl.float32) * normed.to(tl.float32)).to(o_ptr.dtype.element_ty).to(tl.float32)
    z = tl.load(z_ptr + row * stride_z + cols).to(tl.float32)
    y = scaled * (z * tl.sigmoid(z))
    full = cols < H * D
    _quantize_row(y, full, q_ptr + row * (H * D), s_ptr, row, cols)


@triton.jit
def _short_conv_kernel(x_ptr, w_ptr, seqpos_ptr, gate_ptr, a_log_ptr, dt_bias_ptr,
                       q_ptr, k_ptr, v_ptr, z_ptr, g_ptr, beta_ptr,
                       T, stride_x, stride_gate, off_z, off_b, off_a, eps,
                       HK: tl.constexpr, HV: tl.constexpr, D: tl.constexpr, TAPS: tl.constexpr,
                       BLOCK_T: tl.constexpr):
    """Program (token block, group): groups [0, HK) are q heads, [HK, 2HK) k heads, [2HK, 2HK+HV) v heads
    (each convolved, SiLU, q/k unit length), then HV groups copy z, and a last group computes the gates."""
    block = tl.program_id(0)
    group = tl.program_id(1)
    tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
    live = tokens < T
    rows = tokens.to(tl.int64)
    dims = tl.arange(0, D)
    if group < 2 * HK + HV:
        channel = group * D + dims  # conv channel == column of x: q, k, v lie first, in conv order
        seqpos = tl.load(seqpos_ptr + rows, mask=live, other=0)
        x = tl.load(x_ptr + rows[:, None] * stride_x + channel[None, :], mask=live[:, None], other=0.0)
        acc = x.to(tl.float32) * tl.load(w_ptr + channel * TAPS + (TAPS - 1)).to(tl.float32)[None, :]
        for shift in tl.static_range(1, TAPS):
            keep = live & (seqpos >= shift)  # never across a prompt boundary (positions restart at 0)
            prev = tl.load(x_ptr + (rows - shift)[:, None] * stride_x + channel[None, :], mask=keep[:, None],
                           other=0.0)
            tap = tl.load(w_ptr + channel * TAPS + (TAPS - 1 - shift)).to(tl.float32)
            acc += prev.to(tl.float32) * tap[None, :]
        # As causal_conv1d: the sum rounded to the input dtype, SiLU on that, rounded again.
        pre = acc.to(x_ptr.dtype.element_ty).to(tl.float32)
        y = (pre * tl.sigmoid(pre)).to(x_ptr.dtype.element_ty)
        if group < 2 * HK:
            yf = y.to(tl.float32)
            y = (yf * tl.rsqrt(tl.sum(yf * yf, axis=1) + eps)[:, None]).to(x_ptr.dtype.element_ty)
            if group < HK:
                tl.store(q_ptr + rows[:, None] * (HK * D) + group * D + dims[None, :], y, mask=live[:, None])
            else:
                tl.store(k_ptr + rows[:, None] * (HK * D) + (group - HK) * D + dims[None, :], y,
                         mask=live[:, None])
        else:
            head = group - 2 * HK
            tl.store(v_ptr + rows[:, None] * (HV * D) + head * D + dims[None, :], y, mask=live[:, None])
    elif group < 2 * HK + 2 * HV:
        head = group - 2 * HK - HV
        z = tl.load(x_ptr + rows[:, None] * stride_x + off_z + head * D + dims[None, :], mask=live[:, None])
        tl.store(z_ptr + rows[:, None] * (HV * D) + head * D + dims[None, :], z, mask=live[:, None])
    else:
        heads = tl.arange(0, HV)
        b = tl.load(gate_ptr + rows[:, None] * stride_gate + off_b + heads[None, :], mask=live[:, None],
                    other=0.0).to(tl.float32)
        a = tl.load(gate_ptr + rows[:, None] * stride_gate + off_a + heads[None, :], mask=live[:, None],
                    other=0.0).to(tl.float32)
        decay = tl.exp(tl.load(a_log_ptr + heads).to(tl.float32))
        x = a + tl.load(dt_bias_ptr + heads).to(tl.float32)[None, :]
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's threshold 20
        offsets = rows[:, None] * HV + heads[None, :]
        tl.store(g_ptr + offsets, -decay[None, :] * softplus, mask=live[:, None])
        tl.store(beta_ptr + offsets, tl.sigmoid(b).to(beta_ptr.dtype.element_ty), mask=live[:, None])


# ---- custom ops ----

@torch.library.custom_op("dq::swiglu_quant", mutates_args=())
def swiglu_quant(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up of [gate | up] rows, as FP8 values and (T, 1) scales."""
    T, width = gate_up.shape
    I = width // 2
    q = torch.empty((T, I), dtype=torch.float8_e4m3fn, device=gate_up.device)
    scale = torch.empty((T, 1), dtype=torch.float32, device=gate_up.device)
    _swiglu_quant_kernel[(T,)](gate_up, q, scale, gate_up.stride(0), I, BLOCK=triton.next_power_of_2(I),
                               num_warps=16)
    return q, scale


@swiglu_quant.register_fake
def _(gate_up):
    T, width = gate_up.shape
    return (gate_up.new_empty((T, width // 2), dtype=torch.float8_e4m3fn),
            gate_up.new_empty((T, 1), dtype=torch.float32))


@torch.library.custom_op("dq::gated_rms_norm_quant", mutates_args=())
def gated_rms_norm_quant(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of o (T, H, D) times weight and silu(z) (T, H * D), as FP8 values and (T, 1)
    scales."""
    T, H, D = o.shape
    q = torch.empty((T, H * D), dtype=torch.float8_e4m3fn, device=o.device)
    scale = torch.empty((T, 1), dtype=torch.float32, device=o.device)
    _gated_rms_norm_quant_kernel[(T,)](o, z, weight, q, scale, o.stride(0), z.stride(0), eps, H=H, D=D,
                                       num_warps=8)
    return q, scale


@gated_rms_norm_quant.register_fake
def _(o, z, weight, eps):
    T, H, D = o.shape
    return (o.new_empty((T, H * D), dtype=torch.float8_e4m3fn), o.new_empty((T, 1), dtype=torch.float32))


@torch.library.custom_op("dq::short_conv_", mutates_args=("q", "k", "v", "z", "g", "beta"))
def short_conv_(x: torch.Tensor, weight: torch.Tensor, seqpos: torch.Tensor, gates: torch.Tensor,
                a_log: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                z: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, off_z: int, off_b: int,
                off_a: int) -> None:
    """x (T, >= off_z + value_dim): the in-projection's output, [q | k | v | z ...] columns (q, k, v in the
    convolution's channel order); gates: the tensor holding b at column off_b and a at off_a (x itself or the
    separate gate projection's output). Writes q, k (T, HK, D) unit length per head, v (T, HV, D), z (T, HV *
    D), g (T, HV) fp32 and beta (T, HV)."""
    T = x.shape[0]
    _, HK, D = q.shape
    HV = v.shape[1]
    block_t = 32
    grid = (triton.cdiv(T, block_t), 2 * HK + 2 * HV + 1)
    _short_conv_kernel[grid](x, weight, seqpos, gates, a_log, dt_bias, q, k, v, z, g, beta, T, x.stride(0),
                             gates.stride(0), off_z, off_b, off_a, 1e-6, HK=HK, HV=HV, D=D,
                             TAPS=weight.shape[1], BLOCK_T=block_t, num_warps=4)


@short_conv_.register_fake
def _(x, weight, seqpos, gates, a_log, dt_bias, q, k, v, z, g, beta, off_z, off_b, off_a):
    return None


# ---- the Ops functions that use them ----

def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def swiglu(gate_up: torch.Tensor, target: Linear | None = None) -> torch.Tensor | Quantized:
    if isinstance(target, Fp8) and gate_up.dtype in HALF and gate_up.stride(-1) == 1:
        values, scale = swiglu_quant(gate_up)
        return Quantized(values, scale, gate_up.dtype)
    return plain.swiglu(gate_up)


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
               target: Linear | None = None
               ) -> torch.Tensor | Quantized:
    _, heads, dim = o.shape
    if (isinstance(target, Fp8) and o.dtype in HALF and _pow2(heads) and _pow2(dim) and o.is_contiguous()
            and z.stride(-1) == 1):
        values, scale = gated_rms_norm_quant(o, z, weight, eps)
        return Quantized(values, scale, o.dtype)
    return plain.gated_norm(o, z, weight, eps)


def short_conv(x: torch.Tensor, gates: torch.Tensor, offsets: tuple[int, int, int], weight: torch.Tensor,
               a_log: torch.Tensor, dt_bias: torch.Tensor, d: Any, seqpos: torch.Tensor,
               outs: Sequence[torch.Tensor] | None = None) -> Sequence[torch.Tensor]:
    """ops.short_conv in one kernel (see there)."""
    if not (x.dtype in HALF and d.head_k == d.head_v and _pow2(d.head_k) and _pow2(d.v_heads)
            and x.stride(-1) == 1 and gates.stride(-1) == 1 and weight.is_contiguous()):
        return plain.short_conv(x, gates, offsets, weight, a_log, dt_bias, d, seqpos, outs)
    tokens = x.shape[0]
    if outs is None:  # q, k, v, g, beta, z: the order pre_linear hands over
        outs = (x.new_empty(tokens, d.k_heads, d.head_k), x.new_empty(tokens, d.k_heads, d.head_k),
                x.new_empty(tokens, d.v_heads, d.head_v), x.new_empty(tokens, d.v_heads, dtype=torch.float32),
                x.new_empty(tokens, d.v_heads), x.new_empty(tokens, d.value_dim))
    assert all(out.is_contiguous() for out in outs), "the kernel writes dense rows"
    q, k, v, g, beta, z = outs
    short_conv_(x, weight, seqpos, gates, a_log, dt_bias, q, k, v, z, g, beta, *offsets)
    return outs


def fused_ops(base: Ops) -> Ops:
    """``base`` with the fused kernels in place of the plain functions they replace."""
    return dataclasses.replace(base, swiglu=swiglu, gated_norm=gated_norm, short_conv=short_conv)
