"""FP8 rowwise weights for the fast path (Hopper and Ada): float8_e4m3fn with one scale per output channel.

Activations get one scale per token at run time (ops.fp8_linear); ``torch._scaled_mm`` multiplies in FP8 and
accumulates in fp32. Only the fast path's own fused copies are converted: the checkpoint's modules keep their
bf16 weights, so the reference engine of the same model is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import ALTERNATIVE, FastPathUnavailable
from .layers import FullAttn
from .ops import FP8_MAX, Dense, Fp8


def require_fp8(device: torch.device) -> None:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise FastPathUnavailable(f"fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, Hopper); "
                                  f"{device} has none: turn fp8 off (--no-fp8), or {ALTERNATIVE}")


def eligible(dense: Dense) -> bool:
    """torch._scaled_mm wants both matrix dimensions divisible by 16."""
    out_features, in_features = dense.weight.shape
    return out_features % 16 == 0 and in_features % 16 == 0


def quantize(dense: Dense) -> Fp8:
    weight = dense.weight.float()
    scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    qweight = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return Fp8(qweight, scale.t().contiguous(), dense.bias)


def rows(matrix: Fp8, start: int, stop: int) -> Fp8:
    """Output channels ``start:stop`` of a quantized matrix (same values as quantizing those rows alone)."""
    return Fp8(matrix.qweight[start:stop], matrix.scale[:, start:stop].contiguous(),
               None if matrix.bias is None else matrix.bias[start:stop])


def convert(weights: Any) -> Any:
    """The same weights tuple with every eligible ``Dense`` quantized (nested tuples included)."""
    if isinstance(weights, FullAttn):
        # q and kv are row ranges of qkv: slice the quantized matrix instead of keeping bf16 copies alive.
        qkv = quantize(weights.qkv) if eligible(weights.qkv) else weights.qkv
        q_rows = weights.q.weight.shape[0]
        if isinstance(qkv, Fp8):
            query, key_value = rows(qkv, 0, q_rows), rows(qkv, q_rows, qkv.qweight.shape[0])
        else:
            query, key_value = weights.q, weights.kv
        rest = {name: convert(getattr(weights, name)) for name in ("o_proj", "mlp")}
        return weights._replace(qkv=qkv, q=query, kv=key_value, **rest)
    if isinstance(weights, Dense):
        return quantize(weights) if eligible(weights) else weights
    if isinstance(weights, tuple) and hasattr(weights, "_fields"):
        return type(weights)(*(convert(value) for value in weights))
    return weights


def count(weights: Any) -> int:
    """Quantized matrices in ``weights`` (reported at start-up)."""
    if isinstance(weights, Fp8):
        return 1
    if isinstance(weights, tuple) and not isinstance(weights, Dense):
        return sum(count(value) for value in weights)
    return 0

