"""Kernels that take element-wise passes off the bf16 forward (``--epilogues``; off by default: residual and
swiglu measured 3.9% faster end to end on an H100 but moved answers to 1.7 times the bf16 floor, and an
epilogue that cannot meet the floor ships off (docs/BENCHMARKS.md, "The gate"); gated_norm saved nothing):

- ``swiglu``: the MLP's gate/up GEMM computes, per output tile of the inner dimension, the gate tile and the
  up tile from the same input tile and writes silu(gate) * up: the (tokens, 2 x inner) product is never stored
  or read back. A persistent Triton GEMM on TMA descriptors (Hopper); elsewhere the unfused path runs.
- ``residual``: ``hidden + x @ W.T`` as cuBLAS's beta = 1 epilogue, in place on ``hidden`` (``addmm_``): the
  GEMM reads the residual and writes the sum, so the norm after it reads one tensor instead of the product and
  the residual.
- ``gated_norm``: the delta rule's gated output norm in one pass with a bf16 result (worker/fast/fused.py has
  the FP8 twin): reads o and z, writes one tensor.

Rounding is the compiled path's: the GEMM's outputs are rounded to bf16 before SwiGLU, which then runs in fp32
and rounds once; the residual sum in place, no extra pass over the hidden state, rounded as the unfused path
rounds it (cuBLAS's bf16 beta = 1 rounds the product first: an H100 gives the unfused path's bits,
tests/gpu/test_epilogues.py; one bf16 step apart at most); the gated norm rounds as Qwen3_5RMSNormGated. Each
kernel is a torch custom op, so compiled pieces call it as one kernel and CUDA graphs capture it.
Deterministic mode keeps them: rows are independent, the GEMM never splits K and sums K in one fixed order,
and runs one configuration for every token count there (``deterministic``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .ops import Dense, Fp8, Linear, Ops, Quantized

HALF = (torch.bfloat16, torch.float16)
log = logging.getLogger(__name__)


class GemmConfig(NamedTuple):
    """One tiling of the gate/up GEMM with SwiGLU: block sizes, grouping, pipeline stages and warps."""

    block_m: int
    block_n: int  # of each half: the tile computes 2 x block_n columns of the product
    block_k: int
    group_m: int  # tiles of this many row blocks run together (L2 reuse of the weight tiles)
    stages: int
    warps: int


# A fixed set, chosen by token count without timing anything at run time (ops/bench/levers.py times each).
# Every configuration has the same block_k, so one output sums K in the same order whichever runs.
CONFIGS = {
    # a 128 x 256 tile over both halves: Hopper's widest MMA tile
    "128x128": GemmConfig(128, 128, 64, 8, 3, 8),
    "128x128s4": GemmConfig(128, 128, 64, 8, 4, 8),  # 224 KiB of shared memory: just under Hopper's 227
    "128x64": GemmConfig(128, 64, 64, 8, 4, 4),
    "64x128": GemmConfig(64, 128, 64, 8, 4, 4),
}
BY_TOKENS = ((4096, "128x128"), (0, "128x64"))  # the first whose floor the token count reaches
INVARIANT = "128x128"  # deterministic mode: one configuration for every token count


def config_for(tokens: int, deterministic: bool) -> GemmConfig:
    name = INVARIANT if deterministic else next(name for floor, name in BY_TOKENS if tokens >= floor)
    return CONFIGS[name]


@triton.jit
def _tile(tile, in_group, row_blocks, GROUP_M: tl.constexpr):
    group = tile // in_group
    first = group * GROUP_M
    rows = min(row_blocks - first, GROUP_M)
    return first + (tile % rows), (tile % in_group) // rows


@triton.jit
def _gate_up_swiglu_kernel(x_desc, w_desc, out_desc, M, I, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr):
    """Persistent: program p computes output tiles p, p + PROGRAMS, ... ``w_desc`` views the weight [gate; up]
    as (2, I, K): one load brings a gate tile and the up tile of the same columns, and one MMA (BLOCK_M x 2
    BLOCK_N) computes both (two accumulators serialise Hopper's wgmma in the flattened loop: ptxas warns
    C7515)."""
    row_blocks = tl.cdiv(M, BLOCK_M)
    col_blocks = tl.cdiv(I, BLOCK_N)
    in_group = GROUP_M * col_blocks
    k_blocks = tl.cdiv(K, BLOCK_K)
    # a second tile counter for the epilogue, as Triton's persistent matmul
    stored = tl.program_id(0) - PROGRAMS
    for tile in tl.range(tl.program_id(0), row_blocks * col_blocks, PROGRAMS, flatten=True):
        block_m, block_n = _tile(tile, in_group, row_blocks, GROUP_M)
        off_m = block_m * BLOCK_M
        off_n = block_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k in range(k_blocks):  # K in ascending blocks, never split: a row's sums do not depend on M
            w = w_desc.load([0, off_n, k * BLOCK_K]).reshape(2 * BLOCK_N, BLOCK_K)
            acc = tl.dot(x_desc.load([off_m, k * BLOCK_K]), w.T, acc)
        stored += PROGRAMS
        block_m, block_n = _tile(stored, in_group, row_blocks, GROUP_M)
        gate, up = acc.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1).split()
        # As the unfused path: the GEMM's outputs rounded to the activation dtype, SwiGLU in fp32, rounded
        # once.
        g = gate.to(out_desc.dtype).to(tl.float32)
        u = up.to(out_desc.dtype).to(tl.float32)
        out_desc.store([block_m * BLOCK_M, block_n * BLOCK_N], (g * tl.sigmoid(g) * u).to(out_desc.dtype))


@functools.cache
def _programs(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _unfused_swiglu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, weight).float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def _descriptors_fit(*tensors: torch.Tensor) -> bool:
    """TMA: 16-byte aligned base and row stride, unit column stride."""
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
               for t in tensors)


def run_gate_up_swiglu(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig) -> torch.Tensor:
    """The kernel in one configuration (ops/bench/levers.py times each); unfused where its descriptors do not
    fit."""
    M, K = x.shape
    inner = weight.shape[0] // 2
    out = x.new_empty((M, inner))
    if M == 0:
        return out
    if inner % config.block_n or not _descriptors_fit(x, weight, out):
        return out.copy_(_unfused_swiglu(x, weight))  # the same roundings, cuBLAS's sums
    programs = _programs(x.device)  # one per SM whatever M (those without a tile return): one compilation
    halves = TensorDescriptor(weight, [2, inner, K], [inner * weight.stride(0), weight.stride(0), 1],
                              [2, config.block_n, config.block_k])
    _gate_up_swiglu_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [config.block_m, config.block_k]), halves,
        TensorDescriptor.from_tensor(out, [config.block_m, config.block_n]), M, inner, K,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        PROGRAMS=programs, num_stages=config.stages, num_warps=config.warps)
    return out


@torch.library.custom_op("dq::gate_up_swiglu", mutates_args=())
def gate_up_swiglu(x: torch.Tensor, weight: torch.Tensor, deterministic: bool) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for weight = [gate; up] (2I, K) -> (M, I); ``deterministic``:
    deterministic mode's configuration whatever M."""
    return run_gate_up_swiglu(x, weight, config_for(x.shape[0], deterministic))


@gate_up_swiglu.register_fake
def _(x, weight, deterministic):
    return x.new_empty((x.shape[0], weight.shape[0] // 2))


@torch.library.custom_op("dq::add_linear_", mutates_args=("hidden",))
def add_linear_(hidden: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """hidden += x @ weight.T in one GEMM (beta = 1), in place."""
    hidden.addmm_(x, weight.t())


@add_linear_.register_fake
def _(hidden, x, weight):
    return None


@triton.jit
def _gated_rms_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, stride_o, stride_z, eps, H: tl.constexpr,
                           D: tl.constexpr):
    """One token: every head of o (H, D) normalised, times weight (D,), times silu(z)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, H)[:, None] * D + tl.arange(0, D)[None, :]
    o = tl.load(o_ptr + row * stride_o + cols).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(o * o, axis=1) / D + eps)
    # As Qwen3_5RMSNormGated: normalised value and weight product rounded to the input dtype, gate in fp32.
    normed = (o * rstd[:, None]).to(o_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(w_ptr + tl.arange(0, D)[None, :]).to(tl.float32)
    scaled = (weight * normed).to(o_ptr.dtype.element_ty).to(tl.float32)
    z = tl.load(z_ptr + row * stride_z + cols).to(tl.float32)
    tl.store(out_ptr + row * (H * D) + cols, (scaled * (z * tl.sigmoid(z))).to(o_ptr.dtype.element_ty))


@torch.library.custom_op("dq::gated_rms_norm", mutates_args=())
def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm of o (T, H, D) times weight and silu(z) (T, H * D) -> (T, H * D) in o's dtype."""
    T, H, D = o.shape
    out = o.new_empty((T, H * D))
    if T:
        _gated_rms_norm_kernel[(T,)](o, z, weight, out, o.stride(0), z.stride(0), eps, H=H, D=D, num_warps=4)
    return out


@gated_rms_norm.register_fake
def _(o, z, weight, eps):
    return o.new_empty((o.shape[0], o.shape[1] * o.shape[2]))


# ---- the Ops functions ----

def _tma(device: torch.device) -> bool:
    """TMA descriptors: Hopper or newer, or Triton's interpreter (CPU tests)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def epilogue_ops(base: Ops, device: torch.device, *, swiglu: bool = False, residual: bool = False,
                 gated_norm: bool = False, deterministic: bool = False) -> Ops:
    """``base`` with the chosen kernels where they apply (bf16 or fp16, unquantised weights, and for
    ``swiglu`` a ``device`` with TMA); elsewhere, and for FP8 weights, ``base``'s functions.
    ``deterministic``: deterministic mode."""
    changes = {}
    tma = _tma(device)
    if swiglu and not tma:  # said once, at start-up: the other kernels still apply
        log.info("--epilogues swiglu not applied on %s: its GEMM needs TMA (Hopper or newer)", device)

    def gate_up(normed: torch.Tensor, gate_up: Linear, target: Linear | None = None) -> torch.Tensor | None:
        # An FP8 down projection (``target``) takes SwiGLU's output quantised: base's path does that.
        unquantised = isinstance(gate_up, Dense) and gate_up.bias is None and not isinstance(target, Fp8)
        if tma and unquantised and normed.dim() == 2 and normed.dtype in HALF and gate_up.weight.dtype == normed.dtype:
            return gate_up_swiglu(normed, gate_up.weight, deterministic)
        return base.gate_up_swiglu(normed, gate_up, target)

    def add_linear(hidden: torch.Tensor, inputs: torch.Tensor | Quantized, weights: Linear) -> torch.Tensor:
        if (isinstance(weights, Dense) and weights.bias is None and isinstance(inputs, torch.Tensor)
                and hidden.dim() == inputs.dim() == 2 and hidden.dtype in HALF
                and inputs.dtype == weights.weight.dtype == hidden.dtype):
            add_linear_(hidden, inputs, weights.weight)
            return hidden
        return base.add_linear(hidden, inputs, weights)

    def norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, target: Linear | None = None
             ) -> torch.Tensor | Quantized:
        _, heads, dim = o.shape
        if (isinstance(target, Dense) and o.dtype in HALF and _pow2(heads) and _pow2(dim) and o.is_contiguous()
                and z.stride(-1) == 1 and weight.is_contiguous()):
            return gated_rms_norm(o, z, weight, eps)
        return base.gated_norm(o, z, weight, eps, target)

    if swiglu:
        changes["gate_up_swiglu"] = gate_up
    if residual:
        changes["add_linear"] = add_linear
    if gated_norm:
        changes["gated_norm"] = norm
    return dataclasses.replace(base, **changes)
