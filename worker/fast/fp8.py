"""FP8 rowwise weights for the fast path (Hopper and Ada): float8_e4m3fn with one scale per output channel.

Activations get one scale per token at run time (ops.fp8_linear); ``torch._scaled_mm`` multiplies in FP8. Only
the fast path's own fused copies are converted: the checkpoint's modules keep their bf16 weights, so the
reference engine of the same model is unchanged.

What stays in bf16: the linear layers' gate projections (in_proj_b and in_proj_a, which set the delta rule's
write strength and decay, whose error would compound along each prompt; published FP8 recipes for Qwen3.5 and
Qwen3-Next leave them unquantised too), the decision head, the embeddings, every layer that ``layers`` leaves
out and every family of matrices that ``families`` leaves out (``--fp8-matrices``: the MLPs carry most of the
GEMM time): FP8 is opt-in per layer and family, because at the 2B shape its rounding moves the answers about
ten times as much as bf16's own (docs/BENCHMARKS.md, FP8 fidelity).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..fast_options import FP8_FAMILIES, layer_choice
from .errors import ALTERNATIVE, FastPathUnavailable
from .layers import FULL, LINEAR, FullAttn, LinearAttn
from .ops import FP8_MAX, Dense, Fp8


def require_fp8(device: torch.device) -> None:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise FastPathUnavailable("fp8 needs an NVIDIA GPU of compute capability 8.9 or newer (Ada, "
                                  f"Hopper); {device} has none: turn fp8 off (--no-fp8), or {ALTERNATIVE}")


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


def chosen_layers(spec: str, kinds: Sequence[str]) -> set[int]:
    """The layers of a model (``kinds``: each layer's block type) an ``fp8_layers`` setting names
    (worker/fast_options.py): "all", "full" (the full-attention layers), "linear" (the linear-attention ones),
    "late" (the second half: FP8's rounding in a layer moves the answers less the later the layer, at the 2B
    shape from 0.057 in layer 0 to 0.003 in layer 23), or layer indices and ranges ("0-5,18")."""
    choice = layer_choice(spec)
    if choice == "late":
        return set(range(len(kinds) // 2, len(kinds)))
    if isinstance(choice, str):
        wanted = {"all": None, "full": FULL, "linear": LINEAR}[choice]
        return {i for i, kind in enumerate(kinds) if wanted in (None, kind)}
    if max(choice) >= len(kinds):
        raise ValueError(f"fp8_layers {spec!r} names no layer of this model's {len(kinds)} "
                         f"(0-{len(kinds) - 1})")
    return set(choice)


def convert(weights: Any, families: frozenset[str] = frozenset(FP8_FAMILIES)) -> Any:
    """The same weights tuple with every eligible ``Dense`` of the chosen ``families`` quantized (nested
    tuples included); a linear layer's gate rows stay bf16, apart."""
    if isinstance(weights, (LinearAttn, FullAttn)) and "mlp" in families:
        weights = weights._replace(mlp=convert(weights.mlp))
    if isinstance(weights, LinearAttn) and weights.gates is None and "linear" in families:
        split = weights.in_proj.weight.shape[0] - 2 * weights.a_log.shape[0]  # b and a: a row per value head
        weight, bias = weights.in_proj
        main = Dense(weight[:split], None if bias is None else bias[:split])
        rest = {"out_proj": convert(weights.out_proj)}
        if not eligible(main):
            return weights._replace(**rest)
        # Contiguous copies of the gate rows, so that the full bf16 matrix is freed.
        gates = Dense(weight[split:].contiguous(), None if bias is None else bias[split:].contiguous())
        return weights._replace(in_proj=quantize(main), gates=gates, **rest)
    if isinstance(weights, FullAttn) and "attention" in families:
        # q and kv are row ranges of qkv: slice the quantized matrix instead of keeping bf16 copies alive.
        qkv = quantize(weights.qkv) if eligible(weights.qkv) else weights.qkv
        q_rows = weights.q.weight.shape[0]
        if isinstance(qkv, Fp8):
            query, key_value = rows(qkv, 0, q_rows), rows(qkv, q_rows, qkv.qweight.shape[0])
        else:
            query, key_value = weights.q, weights.kv
        return weights._replace(qkv=qkv, q=query, kv=key_value, o_proj=convert(weights.o_proj))
    if isinstance(weights, (LinearAttn, FullAttn)):
        return weights
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

