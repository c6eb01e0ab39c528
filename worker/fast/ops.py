"""Pure tensor functions of the packed forward: the Qwen3.5 layer math in a (tokens, features) layout.

Each function reproduces one step of transformers' Qwen3.5 modules with the same dtype rules (fp32 norms, bf16
residual stream), so that the fast path stays within rounding of the reference. They take tensors only, which lets
torch.compile reuse one compiled graph for every layer. ``Ops`` bundles them so that ``compile="sub"`` can swap in
compiled versions without touching the layer code.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, NamedTuple

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


Linear = Dense | Fp8
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def linear(x: torch.Tensor, w: Linear) -> torch.Tensor:
    if isinstance(w, Fp8):
        return fp8_linear(x, w)
    return F.linear(x, w.weight, w.bias)


def fp8_linear(x: torch.Tensor, w: Fp8) -> torch.Tensor:
    """Rowwise FP8 matmul: one scale per token (computed here) and one per output channel (precomputed)."""
    flat = x.reshape(-1, x.shape[-1])
    scale = flat.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    quantized = (flat.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(quantized, w.qweight.t(), scale_a=scale, scale_b=w.scale, bias=w.bias,
                           out_dtype=x.dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3_5RMSNorm: fp32 statistics, zero-centred weight ``(1 + w)``, result in the input dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3_5RMSNormGated: normalise in fp32, scale in the input dtype, then multiply by silu(gate) in fp32."""
    dtype = x.dtype
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * out.to(dtype)
    return (out * F.silu(gate.float())).to(dtype)


def conv_silu(x: torch.Tensor, weight: torch.Tensor, seqpos: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution over packed (tokens, channels) rows, then SiLU.

    ``weight`` is (channels, taps); tap ``taps - 1`` multiplies the current token. A token at position ``p`` of its
    chunk (``seqpos``) reads only the ``min(p, taps - 1)`` tokens before it, so no chunk sees its neighbour: this is
    what the reference's zero left-padding computes for each prompt on its own. Sums in fp32, rounded to the input
    dtype before the activation as ``causal_conv1d_fn`` does.
    """
    taps = weight.shape[-1]
    wf = weight.float()
    xf = x.float()
    out = xf * wf[:, taps - 1]
    for shift in range(1, taps):
        shifted = F.pad(xf[: xf.shape[0] - shift], (0, 0, shift, 0))
        keep = (seqpos >= shift).unsqueeze(-1)
        out = out + torch.where(keep, shifted, 0.0) * wf[:, taps - 1 - shift]
    return F.silu(out.to(x.dtype))


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Unit length over the last dimension (per head), with the fp32 statistics and eps of fla's and FlashQLA's
    ``use_qk_l2norm_in_kernel``: done here, it fuses into the kernel that stores q and k, and the delta rule's
    Python wrapper skips two compiled calls per layer."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's log-space decay ``g`` (fp32) and write strength ``beta``, as Qwen3_5GatedDeltaNet."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial rotary embedding on (tokens, heads, dim) with (tokens, rotary_dim) tables, as apply_rotary_pos_emb."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat(((x_rot * cos) + (rotate_half(x_rot) * sin), x_pass), dim=-1)


def softcap_head(hidden: torch.Tensor, head: Dense, softcap: float | None) -> torch.Tensor:
    """readout.head: the decision head on final-norm rows, fp32 out, optionally soft-capped."""
    logits = F.linear(hidden.to(head.weight.dtype), head.weight, head.bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


@dataclass(frozen=True)
class Ops:
    """The element-wise building blocks the layers call; ``compiled`` wraps each in torch.compile (``sub``)."""

    rms_norm: Callable[..., torch.Tensor] = rms_norm
    gated_rms_norm: Callable[..., torch.Tensor] = gated_rms_norm
    conv_silu: Callable[..., torch.Tensor] = conv_silu
    gdn_gates: Callable[..., tuple[torch.Tensor, torch.Tensor]] = gdn_gates
    l2_normalize: Callable[..., torch.Tensor] = l2_normalize
    swiglu: Callable[..., torch.Tensor] = swiglu
    rope: Callable[..., torch.Tensor] = rope
    linear: Callable[..., torch.Tensor] = linear

    def compiled(self) -> Ops:
        # linear stays eager: cuBLAS does the work; compiling it would only add guards.
        return Ops(**{f.name: getattr(self, f.name) if f.name == "linear"
                      else torch.compile(getattr(self, f.name), dynamic=True) for f in fields(self)})
