"""Pure tensor functions of the packed forward: the Qwen3.5 layer math in a (tokens, features) layout.

Each function reproduces one step of transformers' Qwen3.5 modules with the same dtype rules (fp32 norms, bf16
residual stream), so that the fast path stays within rounding of the reference. They take tensors only, which
lets torch.compile reuse one compiled graph for every layer. ``Ops`` bundles them so that ``compile="sub"``
can swap in compiled versions, and worker/fast/fused.py its one-pass Triton kernels, without touching the
layer code.

A function that feeds a GEMM takes that GEMM's weights as ``target``: the fused kernels then hand over the
activation already quantised (``Quantized``) when the GEMM is FP8; the plain functions ignore it and the GEMM
quantises (the same rowwise rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F


class Dense(NamedTuple):
    """A linear layer's weights (out, in) and optional bias, as the checkpoint holds them."""

    weight: torch.Tensor
    bias: torch.Tensor | None = None


class Fp8(NamedTuple):
    """A linear layer in float8_e4m3fn with one fp32 scale per output channel (see worker/fast/fp8.py)."""

    qweight: torch.Tensor  # (out, in) float8_e4m3fn
    scale: torch.Tensor  # (1, out) float32
    bias: torch.Tensor | None = None


class Quantized(NamedTuple):
    """An activation (tokens, features) already in FP8 for its GEMM, one fp32 scale per token."""

    values: torch.Tensor  # (T, K) float8_e4m3fn
    scale: torch.Tensor  # (T, 1) float32
    dtype: torch.dtype  # of the activation it stands for, and of the GEMM's output


Linear = Dense | Fp8
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def linear(inputs: torch.Tensor | Quantized, weights: Linear) -> torch.Tensor:
    if isinstance(weights, Fp8):
        return fp8_linear(inputs, weights)
    assert not isinstance(inputs, Quantized), "only an FP8 GEMM takes a quantised activation"
    return F.linear(inputs, weights.weight, weights.bias)


def quantize(inputs: torch.Tensor) -> Quantized:
    """Rowwise FP8: scale = amax / 448 per row, values rounded to nearest."""
    scale = inputs.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    values = (inputs.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Quantized(values, scale, inputs.dtype)


def fp8_linear(inputs: torch.Tensor | Quantized, weights: Fp8) -> torch.Tensor:
    """Rowwise FP8 matmul: one scale per token and one per output channel (precomputed). Fast accumulation (as
    torchao's FP8 inference default): 36.0 -> 30.8 ms of GEMMs per 16k-token 2B pack on an H200, and no change
    in the answers beyond FP8's own rounding (docs/BENCHMARKS.md, FP8 fidelity)."""
    if isinstance(inputs, Quantized):
        quantized, lead = inputs, inputs.values.shape[:-1]
    else:
        quantized, lead = quantize(inputs.reshape(-1, inputs.shape[-1])), inputs.shape[:-1]
    out = torch._scaled_mm(quantized.values, weights.qweight.t(), scale_a=quantized.scale,
                           scale_b=weights.scale, bias=weights.bias, out_dtype=quantized.dtype,
                           use_fast_accum=True)
    return out.reshape(*lead, out.shape[-1])


def rms_norm(inputs: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3_5RMSNorm: fp32 statistics, zero-centred weight ``(1 + weight)``, result in the input dtype."""
    inputs_fp32 = inputs.float()
    out = inputs_fp32 * torch.rsqrt(inputs_fp32.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(inputs)


def gated_rms_norm(inputs: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """Qwen3_5RMSNormGated: normalise in fp32, scale in the input dtype, then multiply by silu(gate) in
    fp32."""
    dtype = inputs.dtype
    inputs_fp32 = inputs.float()
    out = inputs_fp32 * torch.rsqrt(inputs_fp32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * out.to(dtype)
    return (out * F.silu(gate.float())).to(dtype)


def conv_silu(inputs: torch.Tensor, weight: torch.Tensor, seqpos: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution over packed (tokens, channels) rows, then SiLU.

    ``weight`` is (channels, taps); tap ``taps - 1`` multiplies the current token. A token at position ``p``
    of its prompt (``seqpos``) reads only the ``min(p, taps - 1)`` tokens before it, so no prompt sees its
    neighbour: this is what the reference's zero left-padding computes for each prompt on its own. Sums in
    fp32, rounded to the input dtype before the activation as ``causal_conv1d_fn`` does.
    """
    taps = weight.shape[-1]
    weight_fp32 = weight.float()
    inputs_fp32 = inputs.float()
    out = inputs_fp32 * weight_fp32[:, taps - 1]
    for shift in range(1, taps):
        shifted = F.pad(inputs_fp32[: inputs_fp32.shape[0] - shift], (0, 0, shift, 0))
        keep = (seqpos >= shift).unsqueeze(-1)
        out = out + torch.where(keep, shifted, 0.0) * weight_fp32[:, taps - 1 - shift]
    return F.silu(out.to(inputs.dtype))


def l2_normalize(inputs: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Unit length over the last dimension (per head), with the fp32 statistics and eps of fla's and
    FlashQLA's ``use_qk_l2norm_in_kernel``: done here, it fuses into the kernel that stores q and k, and the
    delta rule's Python wrapper skips two compiled calls per layer."""
    inputs_fp32 = inputs.float()
    scale = torch.rsqrt((inputs_fp32 * inputs_fp32).sum(-1, keepdim=True) + eps)
    return (inputs_fp32 * scale).to(inputs.dtype)


def gdn_gates(decay_in: torch.Tensor, beta_in: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's log-space decay (its ``g``, fp32) and write strength ``beta``, as Qwen3_5GatedDeltaNet
    computes them from its projections ``a`` (``decay_in``) and ``b`` (``beta_in``)."""
    decay = -a_log.float().exp() * F.softplus(decay_in.float() + dt_bias)
    return decay, beta_in.sigmoid()


def swiglu(gate_up: torch.Tensor, target: Linear | None = None) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gate_up_swiglu(normed: torch.Tensor, gate_up: Linear,
                   target: Linear | None = None) -> torch.Tensor | None:
    """The MLP's gate/up GEMM and SwiGLU in one kernel, where one is chosen (worker/fast/epilogues.py); None:
    the caller runs ``linear`` and ``swiglu``."""
    return None


def add_linear(hidden: torch.Tensor, inputs: torch.Tensor | Quantized, weights: Linear) -> torch.Tensor:
    """A residual update, ``hidden + inputs @ W.T``. The epilogue kernel (worker/fast/epilogues.py) updates
    ``hidden`` in place: callers pass a hidden state they no longer need."""
    return hidden + linear(inputs, weights)


def gated_norm(attended: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
               target: Linear | None = None) -> torch.Tensor:
    """The linear layers' output norm on the delta rule's output (T, H, D) and the gate z (T, H * D), per head
    -> (T, H * D)."""
    tokens, heads, dim = attended.shape
    normed = gated_rms_norm(attended.reshape(-1, dim), gate.reshape(-1, dim), weight, eps)
    return normed.reshape(tokens, heads * dim)


def short_conv(mixed: torch.Tensor, gates: torch.Tensor, offsets: tuple[int, int, int], weight: torch.Tensor,
               a_log: torch.Tensor, dt_bias: torch.Tensor, dims: Any, seqpos: torch.Tensor,
               outs: Sequence[torch.Tensor] | None = None) -> Sequence[torch.Tensor]:
    """Everything a linear layer's delta rule reads, from its in-projection ``mixed`` = [q | k | v | z ...]
    and ``gates`` (holding b and a at ``offsets[1:]``; z starts at ``offsets[0]``): query, key (T, Hk, Dk)
    convolved, SiLU, unit length per head; value (T, Hv, Dv); decay (T, Hv) fp32; beta (T, Hv); z (T, Hv *
    Dv). ``dims``: the layer's LinearDims. ``outs``: static buffers to write them into (returned), else new
    tensors."""
    tokens = mixed.shape[0]
    off_z, off_b, off_a = offsets
    widths = [dims.key_dim, dims.key_dim, dims.value_dim]
    query, key, value = mixed[:, :off_z].split(widths, dim=-1)
    # The convolution is depthwise: one call per output, so that a compiled piece computes each output in the
    # kernel that stores it (one shared result would be materialised in fp32 and read three times).
    query, key, value = (conv_silu(part, taps, seqpos)
                         for part, taps in zip((query, key, value), weight.split(widths)))
    decay, beta = gdn_gates(gates[:, off_a: off_a + dims.v_heads],
                            gates[:, off_b: off_b + dims.v_heads], a_log, dt_bias)
    query, key = (l2_normalize(part.view(tokens, dims.k_heads, dims.head_k)) for part in (query, key))
    result = (query, key, value.view(tokens, dims.v_heads, dims.head_v), decay, beta,
              mixed[:, off_z: off_z + dims.value_dim])
    if outs is None:
        return result
    for out, computed in zip(outs, result, strict=True):
        out.copy_(computed)
    return outs


def rotate_half(inputs: torch.Tensor) -> torch.Tensor:
    half = inputs.shape[-1] // 2
    return torch.cat((-inputs[..., half:], inputs[..., :half]), dim=-1)


def rope(inputs: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotary embedding on (tokens, heads, dim) with (tokens, rotary_dim) tables, as
    apply_rotary_pos_emb."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1]
    rotary_part, pass_part = inputs[..., :rot], inputs[..., rot:]
    return torch.cat(((rotary_part * cos) + (rotate_half(rotary_part) * sin), pass_part), dim=-1)


def softcap_head(hidden: torch.Tensor, head: Dense, softcap: float | None) -> torch.Tensor:
    """readout.head: the decision head on final-norm rows, fp32 out, optionally soft-capped."""
    logits = F.linear(hidden.to(head.weight.dtype), head.weight, head.bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


@dataclass(frozen=True)
class Ops:
    """The element-wise building blocks the layers call; ``compiled`` wraps each in torch.compile
    (``sub``)."""

    rms_norm: Callable[..., torch.Tensor] = rms_norm
    gated_norm: Callable[..., torch.Tensor | Quantized] = gated_norm
    short_conv: Callable[..., Sequence[torch.Tensor]] = short_conv
    swiglu: Callable[..., torch.Tensor | Quantized] = swiglu
    rope: Callable[..., torch.Tensor] = rope
    linear: Callable[..., torch.Tensor] = linear
    gate_up_swiglu: Callable[..., torch.Tensor | None] = gate_up_swiglu
    add_linear: Callable[..., torch.Tensor] = add_linear

    def compiled(self) -> Ops:
        # The GEMMs stay eager: cuBLAS does the work; compiling them would only add guards.
        return Ops(**{f.name: getattr(self, f.name) if f.name in GEMMS
                      else torch.compile(getattr(self, f.name), dynamic=True) for f in fields(self)})


GEMMS = ("linear", "gate_up_swiglu", "add_linear")  # the Ops functions that ``compiled`` leaves eager
