"""Qwen3.5 decoder layers re-expressed over one packed (tokens, hidden) sequence, with the checkpoint's
weights.

Each layer is split at its token mixer: ``pre_*`` (norm, projections, convolution, gates, q/k norms, RoPE) and
``post_*`` (output gate and projection, residual, MLP) are dense and row-local, so they can be compiled and
captured in CUDA graphs; the mixer between them (Gated DeltaNet or varlen attention) reads the prompt
boundaries and runs eagerly (worker/fast/mixers.py). transformers is never patched: the weights are read from
its modules, and the projections a layer applies to the same input are concatenated into one matrix (a copy:
one GEMM instead of three or four).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .ops import Dense, Linear, Ops, softcap_head

LINEAR, FULL = "linear_attention", "full_attention"


class Mlp(NamedTuple):
    """A layer's SwiGLU MLP: its norm, the fused gate/up projection and the down projection."""

    norm: torch.Tensor  # post_attention_layernorm
    gate_up: Linear  # [gate_proj; up_proj]
    down: Linear


class LinearAttn(NamedTuple):
    """A linear-attention (gated delta rule) layer's weights, fused for the packed forward."""

    norm: torch.Tensor  # input_layernorm
    # [in_proj_qkv; in_proj_z; in_proj_b; in_proj_a], or without b and a where ``gates`` holds them
    in_proj: Linear
    conv: torch.Tensor  # (conv_dim, taps)
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    out_norm: torch.Tensor  # the gated RMSNorm's weight
    out_proj: Linear
    mlp: Mlp
    # [in_proj_b; in_proj_a] apart, in bf16, when in_proj is FP8 (worker/fast/fp8.py)
    gates: Dense | None = None


class FullAttn(NamedTuple):
    """A full-attention layer's weights, fused for the packed forward."""

    norm: torch.Tensor
    qkv: Linear  # [q_proj (query and gate, per head); k_proj; v_proj]
    q: Linear  # the q_proj rows of qkv alone (pruned last layer)
    kv: Linear  # the k_proj and v_proj rows alone
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: Linear
    mlp: Mlp


class LinearDims(NamedTuple):
    """A linear-attention layer's sizes: key and value widths, heads, and its norm's epsilon."""

    key_dim: int
    value_dim: int
    k_heads: int
    v_heads: int
    head_k: int
    head_v: int
    eps: float


class FullDims(NamedTuple):
    """A full-attention layer's sizes: heads, key/value heads, head width, scale and epsilon."""

    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    eps: float


class Head(NamedTuple):
    """The decision head: the backbone's final norm, the verbalizer projection and its softcap."""

    norm: torch.Tensor  # the backbone's final norm
    proj: Dense
    softcap: float | None
    eps: float


def _dense(*modules: torch.nn.Linear) -> Dense:
    weight = (torch.cat([m.weight.detach() for m in modules]) if len(modules) > 1
              else modules[0].weight.detach())
    biases = [m.bias for m in modules]
    bias = None if all(b is None for b in biases) else torch.cat([
        (b.detach() if b is not None else torch.zeros(m.out_features, dtype=weight.dtype,
                                                      device=weight.device))
        for m, b in zip(modules, biases)])
    return Dense(weight, bias)


def _split(dense: Dense, start: int, stop: int) -> Dense:
    return Dense(dense.weight[start:stop], None if dense.bias is None else dense.bias[start:stop])


def _mlp(layer: Any) -> Mlp:
    mlp = layer.mlp
    return Mlp(layer.post_attention_layernorm.weight.detach(), _dense(mlp.gate_proj, mlp.up_proj),
               _dense(mlp.down_proj))


def linear_layer(layer: Any) -> tuple[LinearAttn, LinearDims]:
    attn = layer.linear_attn
    assert attn.conv1d.bias is None, "Qwen3.5's convolution has no bias"
    assert attn.activation in ("silu", "swish"), f"unexpected activation {attn.activation}"
    weights = LinearAttn(
        layer.input_layernorm.weight.detach(),
        _dense(attn.in_proj_qkv, attn.in_proj_z, attn.in_proj_b, attn.in_proj_a),
        attn.conv1d.weight.detach()[:, 0], attn.A_log.detach(), attn.dt_bias.detach(),
        attn.norm.weight.detach(), _dense(attn.out_proj), _mlp(layer))
    dims = LinearDims(attn.key_dim, attn.value_dim, attn.num_k_heads, attn.num_v_heads, attn.head_k_dim,
                      attn.head_v_dim, float(layer.input_layernorm.eps))
    return weights, dims


def full_layer(layer: Any) -> tuple[FullAttn, FullDims]:
    attn = layer.self_attn
    qkv = _dense(attn.q_proj, attn.k_proj, attn.v_proj)
    q_rows = attn.q_proj.out_features
    weights = FullAttn(layer.input_layernorm.weight.detach(), qkv, _split(qkv, 0, q_rows),
                       _split(qkv, q_rows, qkv.weight.shape[0]), attn.q_norm.weight.detach(),
                       attn.k_norm.weight.detach(), _dense(attn.o_proj), _mlp(layer))
    heads = attn.q_proj.out_features // (2 * attn.head_dim)
    dims = FullDims(heads, attn.k_proj.out_features // attn.head_dim, attn.head_dim, float(attn.scaling),
                    float(layer.input_layernorm.eps))
    return weights, dims


def head_weights(language_model: Any, proj: torch.nn.Linear, softcap: float | None) -> Head:
    return Head(language_model.norm.weight.detach(), _dense(proj), softcap, float(language_model.norm.eps))


# ---- dense pieces: (tokens, hidden) in, row-local, no knowledge of prompt boundaries except ``seqpos`` ----

def gate_up(ops: Ops, mlp: Mlp, normed: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the MLP's input: in the GEMM's epilogue where a kernel is chosen, else the GEMM,
    then SwiGLU (quantised where the down projection is FP8)."""
    inner = ops.gate_up_swiglu(normed, mlp.gate_up, mlp.down)
    return inner if inner is not None else ops.swiglu(ops.linear(normed, mlp.gate_up), mlp.down)


def mlp_block(ops: Ops, mlp: Mlp, hidden: torch.Tensor, eps: float) -> torch.Tensor:
    """``hidden`` may be updated in place (ops.add_linear)."""
    normed = ops.rms_norm(hidden, mlp.norm, eps)
    return ops.add_linear(hidden, gate_up(ops, mlp, normed), mlp.down)


def pre_linear(ops: Ops, dims: LinearDims, weights: LinearAttn, hidden: torch.Tensor, seqpos: torch.Tensor,
               outs: Sequence[torch.Tensor] | None = None) -> Sequence[torch.Tensor]:
    """-> query (T, Hk, Dk), key (T, Hk, Dk) both of unit length per head, value (T, Hv, Dv), decay (T, Hv)
    fp32, beta (T, Hv), out_gate (T, value_dim); written into ``outs`` where given (the graphed path's static
    buffers)."""
    normed = ops.rms_norm(hidden, weights.norm, dims.eps)
    projected = ops.linear(normed, weights.in_proj)
    off_gate = 2 * dims.key_dim + dims.value_dim
    if weights.gates is None:  # b and a are the projection's last columns
        gates, off_beta = projected, off_gate + dims.value_dim
    else:
        gates, off_beta = ops.linear(normed, weights.gates), 0
    return ops.short_conv(projected, gates, (off_gate, off_beta, off_beta + dims.v_heads), weights.conv,
                          weights.a_log, weights.dt_bias, dims, seqpos, outs)


def post_linear(ops: Ops, dims: LinearDims, weights: LinearAttn, hidden: torch.Tensor, mixed: torch.Tensor,
                out_gate: torch.Tensor) -> torch.Tensor:
    """mixed: the delta rule's output (T, Hv, Dv). ``hidden`` may be updated in place (ops.add_linear)."""
    core = ops.gated_norm(mixed, out_gate, weights.out_norm, dims.eps, weights.out_proj)
    hidden = ops.add_linear(hidden, core, weights.out_proj)
    return mlp_block(ops, weights.mlp, hidden, dims.eps)


def _query_gate(ops: Ops, dims: FullDims, weights: FullAttn, projected: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    rows = projected.shape[0]
    query, gate = projected.view(rows, dims.heads, 2 * dims.head_dim).chunk(2, dim=-1)
    return ops.rms_norm(query, weights.q_norm, dims.eps), gate.reshape(rows, dims.heads * dims.head_dim)


def pre_full(ops: Ops, dims: FullDims, weights: FullAttn, hidden: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """-> query (T, H, D), key (T, Hkv, D), value (T, Hkv, D), gate (T, H * D)."""
    tokens = hidden.shape[0]
    normed = ops.rms_norm(hidden, weights.norm, dims.eps)
    q_size, kv_size = 2 * dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
    query_and_gate, key, value = ops.linear(normed, weights.qkv).split([q_size, kv_size, kv_size], dim=-1)
    query, gate = _query_gate(ops, dims, weights, query_and_gate)
    key = ops.rms_norm(key.view(tokens, dims.kv_heads, dims.head_dim), weights.k_norm, dims.eps)
    return (ops.rope(query, cos, sin), ops.rope(key, cos, sin),
            value.view(tokens, dims.kv_heads, dims.head_dim), gate)


def pre_full_rows(ops: Ops, dims: FullDims, weights: FullAttn, hidden: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The pruned last layer: keys and values for every token, queries only at the marker ``rows``.
    -> query (R, H, D), key (T, Hkv, D), value (T, Hkv, D), gate (R, H * D), hidden (R, hidden size)."""
    tokens = hidden.shape[0]
    normed = ops.rms_norm(hidden, weights.norm, dims.eps)
    key, value = ops.linear(normed, weights.kv).split([dims.kv_heads * dims.head_dim] * 2, dim=-1)
    key = ops.rms_norm(key.view(tokens, dims.kv_heads, dims.head_dim), weights.k_norm, dims.eps)
    query, gate = _query_gate(ops, dims, weights, ops.linear(normed[rows], weights.q))
    return (ops.rope(query, cos[rows], sin[rows]), ops.rope(key, cos, sin),
            value.view(tokens, dims.kv_heads, dims.head_dim), gate, hidden[rows])


def post_full(ops: Ops, dims: FullDims, weights: FullAttn, hidden: torch.Tensor, mixed: torch.Tensor,
              gate: torch.Tensor) -> torch.Tensor:
    """mixed: attention output (rows, H, D); also the pruned layer's second half, on marker rows only.
    ``hidden`` may be updated in place (ops.add_linear)."""
    hidden = ops.add_linear(hidden, mixed.reshape(hidden.shape[0], -1) * torch.sigmoid(gate), weights.o_proj)
    return mlp_block(ops, weights.mlp, hidden, dims.eps)


def final(ops: Ops, head: Head, hidden: torch.Tensor) -> torch.Tensor:
    """Final norm and the decision head on marker rows ``hidden`` -> (rows, verbalizers) fp32."""
    return softcap_head(ops.rms_norm(hidden, head.norm, head.eps), head.proj, head.softcap)
