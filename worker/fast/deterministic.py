"""Deterministic mode on the GPU: what makes a prompt's logits independent of the pack around it.

A row of the pack is computed by the same kernels, in the same order of sums, whatever else is in the pack,
when:

- the GEMMs never split their inner dimension (split-K, stream-K): cuBLAS picks tiles by M, and a tile's shape
  does not change the order in which one output element sums over K, but splitting K does
  (``prepare_process``, ``enable``; checked at start by ``check_gemms``);
- each compiled piece is one graph for every bucket, the token dimension symbolic (worker/fast/graphs.py),
  with Inductor's configurations chosen without timing anything (``enable``): one kernel configuration per
  operation, so a norm sums a row in the same order at 2,048 and at 16,384 tokens, and in every process;
- the delta rule never splits a prompt across the card (FlashQLA's intra-card split, worker/fast/qla.py), so
  each prompt's recurrence runs in one piece from its first token;
- the pruned last layer's marker rows are the second symbol of those pieces, and no pack leaves the graphs for
  having more questions than its bucket's rows (the packer charges a question ``TOKENS_PER_ROW`` tokens at
  least, worker/model/engine.py, and ``lay_out`` moves such a pack up a bucket);
- the vision tower runs image by image.

Attention (varlen, one sequence per block row) and the element-wise work are row-local already.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from . import ops
from .ops import Dense, Fp8, Linear
from .qla import FlashQLA

if TYPE_CHECKING:
    from ..config import Settings
    from ..model.checkpoint import DecisionModel

log = logging.getLogger(__name__)

# Read by cuBLAS when its handles and workspaces are first made: set before the process's first GPU matmul. A
# workspace too small for split-K leaves cuBLAS only kernels that sum each output in one pass over K.
ENVIRONMENT = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}


class NotDeterministic(RuntimeError):
    """Deterministic mode cannot be kept here (the GEMMs of this card and library depend on M)."""


def by_default(model: DecisionModel, settings: Settings) -> tuple[bool, str]:
    """Whether deterministic mode is on where neither ``--deterministic`` nor ``--no-deterministic`` is given,
    and why: on wherever its kernels run (the fast engine's CUDA graphs of compiled layers, the delta rule on
    FlashQLA: Hopper or Blackwell), off elsewhere. Asked after the model is loaded, before any GPU matmul."""
    if model.device.type != "cuda":
        return False, ("on the CPU it scores each prompt alone, a pass per prompt (--deterministic turns it "
                       "on)")
    if settings.engine == "reference":
        return False, "the reference engine runs fla's kernels, which pick their configuration by timing"
    if not (settings.cuda_graphs and settings.compile == "layer"):
        return False, ("it runs packs from CUDA graphs of compiled layers; here cuda_graphs="
                       f"{settings.cuda_graphs}, compile={settings.compile}")
    config = model.text_config
    if "linear_attention" in (getattr(config, "layer_types", None) or ()):
        head_k, head_v = (getattr(config, f"linear_{kind}_head_dim", 0) for kind in ("key", "value"))
        if not FlashQLA.takes(model.dtype, head_k, head_v):
            return False, ("it runs the delta rule on FlashQLA, which takes bf16 or fp16 and 128-wide heads; "
                           f"this model is {model.dtype} with {head_k}- and {head_v}-wide heads")
        missing = FlashQLA.missing()
        if missing is not None:
            return False, ("it runs the delta rule on FlashQLA (Hopper or Blackwell, flash-qla installed), "
                           f"which does not run here ({missing})")
    return True, "its kernels run here (--no-deterministic turns it off)"


def decide(model: DecisionModel, settings: Settings) -> bool:
    """``--deterministic`` or ``--no-deterministic`` as given, else ``by_default``'s answer, logged with its
    reason (once, as the engine is made)."""
    if settings.deterministic is not None:
        return settings.deterministic
    on, why = by_default(model, settings)
    log.info("deterministic mode %s by default: %s", "on" if on else "off", why)
    return on


def prepare_process() -> None:
    """Before the first GPU matmul of the process (the daemon calls it before loading the checkpoint)."""
    os.environ.update(ENVIRONMENT)


def enable() -> None:
    """Process-wide switches: cuBLAS without split-K, Inductor without timed autotuning."""
    # harmless where already done; too late only where a GPU matmul ran before (check_gemms)
    prepare_process()
    for name in ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction"):
        try:  # torch >= 2.10: (reduced-precision sums allowed, split-K allowed)
            setattr(torch.backends.cuda.matmul, name, (False, False))
        except (TypeError, RuntimeError):
            setattr(torch.backends.cuda.matmul, name, False)
    if torch.cuda.is_available():
        torch.backends.cuda.preferred_blas_library("cublaslt")
    import torch._inductor.config as inductor

    for name in ("deterministic", "batch_invariant"):  # the second only in newer torch
        if hasattr(inductor, name):
            setattr(inductor, name, True)
    inductor.coordinate_descent_tuning = False
    # Heuristics that size a reduction's split by the card's multiprocessor count (the same bits on every card,
    # not only every pack): off, and the autotuned templates that do the same with them, whatever the
    # environment says.
    for owner, name in ((inductor, "split_reductions"), (inductor.triton, "mix_order_reduction"),
                        (inductor.triton, "cooperative_reductions"), (inductor, "max_autotune"),
                        (inductor, "max_autotune_gemm"), (inductor, "max_autotune_pointwise")):
        if hasattr(owner, name):
            setattr(owner, name, False)


def check_gemms(linears: Iterable[Linear], sizes: Iterable[int], dtype: torch.dtype, seed: int = 0) -> int:
    """Each distinct GEMM among ``linears`` (bf16 or FP8, worker/fast/ops.py) run at every row count in
    ``sizes``, its rows laid at other places each time: every row must come out bitwise as at the largest
    size. Catches a library or card whose GEMMs still split K, or settings applied after cuBLAS had started.
    Returns the number of distinct GEMMs checked."""
    sizes = sorted(set(sizes))
    distinct: dict[tuple, Linear] = {}
    for linear in linears:
        matrix = linear.weight if isinstance(linear, Dense) else linear.qweight
        distinct.setdefault((type(linear), tuple(matrix.shape), matrix.device, linear.bias is None), linear)
    generator = torch.Generator().manual_seed(seed)
    most = sizes[-1]
    for (kind, (out_features, in_features), device, _), linear in distinct.items():
        rows = torch.randn(most, in_features, generator=generator).to(device, dtype)
        reference = ops.linear(rows, linear)
        for size in sizes[:-1]:
            # elsewhere than in the reference
            order = torch.arange(size, device=device) + (most - size) // 2 + 1
            got = ops.linear(rows[order], linear)
            if not torch.equal(got, reference[order]):
                worst = (got.float() - reference[order].float()).abs().max().item()
                raise NotDeterministic(
                    f"a {out_features} x {in_features} {kind.__name__} GEMM gives other bits at {size} rows "
                    f"than at {most} (up to {worst:g} apart): this card's or library's matmul depends on the "
                    "batch, or a GPU matmul ran before deterministic mode was set up "
                    "(worker/fast/deterministic.py)")
    return len(distinct)


def linears_of(tree: object) -> list[Linear]:
    """Every Dense and Fp8 inside nested tuples (a layer's or the head's weights)."""
    if isinstance(tree, (Dense, Fp8)):
        return [tree]
    if isinstance(tree, tuple):
        return [linear for item in tree for linear in linears_of(item)]
    return []
