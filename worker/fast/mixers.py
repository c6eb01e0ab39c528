"""The token mixers that read prompt boundaries: Gated DeltaNet (fla) and varlen attention (torch), and a
plain torch stand-in of both for CPU tests.

These run eagerly between the dense pieces (also when the pieces replay as CUDA graphs): their launch shapes
depend on the boundaries. The boundaries come in a ``Boundaries`` built once per pack from the engine's
persistent device buffer; its tensors are fresh views for every pack because fla and FlashQLA cache host-side
preparation by tensor identity, and a reused tensor object would hand them the previous pack's boundaries.

On Hopper and Blackwell with FlashQLA installed, the delta rule calls FlashQLA's forward directly
(worker/fast/qla.py), without fla's dispatch and without a host synchronisation per pack.
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from .errors import ALTERNATIVE, FastPathUnavailable
from .layout import Boundaries
from .qla import FlashQLA

class Mixers(Protocol):
    """The sequence mixers of a pack: the gated delta rule and attention, each within its prompts."""

    def gated_delta(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
                    beta: torch.Tensor, bounds: Boundaries) -> torch.Tensor:
        """(T, Hk, Dk) x2 (unit length per head), (T, Hv, Dv), (T, Hv) x2 -> (T, Hv, Dv); the state restarts
        at every prompt."""

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                  causal: bool, bounds: Boundaries, rows_only: bool = False) -> torch.Tensor:
        """(Tq, H, D), (T, Hkv, D) x2 -> (Tq, H, D) within each prompt; ``rows_only``: queries are marker
        rows."""

    def variant_packs(self, heads: int, budget: int, longest: int = 0) -> dict[Any, list[int]]:
        """Variant -> prompt lengths of a pack (at most ``budget`` tokens, or one prompt of up to
        ``longest``): packs that together reach every kernel variant the mixers compile on first use; the
        engine runs them before it reports ready."""


def _varlen_attn() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        raise FastPathUnavailable(f"the fast engine needs torch >= 2.10 (torch.nn.attention.varlen); "
                                  f"this is torch {torch.__version__}: {ALTERNATIVE}") from None
    return varlen_attn


def _chunk_gated_delta_rule() -> Any:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as error:
        raise FastPathUnavailable(
            f"the fast engine needs flash-linear-attention for the Gated DeltaNet layers "
            f"(pip install 'flash-linear-attention>=0.6' 'fla-core>=0.6', or the project's [gpu] extra; "
            f"import failed: {error}): {ALTERNATIVE}") from None
    return chunk_gated_delta_rule


def _flash_qla(split: bool) -> FlashQLA | None:
    """FlashQLA called directly where it runs; None sends the delta rule through fla's dispatch (its Triton
    kernels elsewhere). ``FLA_FLASH_QLA=0``, fla's switch for it, turns it off here too."""
    if FlashQLA.missing() is not None:
        return None
    return FlashQLA(split)


class CudaMixers:
    """The chunked gated delta rule (FlashQLA's kernels directly where they run, else fla's) and torch's
    varlen attention. ``invariant`` (deterministic mode): FlashQLA never splits a prompt across the card, and
    fla's kernels are refused (they autotune by timing, per process)."""

    def __init__(self, invariant: bool = False) -> None:
        if not torch.cuda.is_available():
            raise FastPathUnavailable("the fast engine needs a CUDA GPU and none is available: "
                                      f"{ALTERNATIVE}")
        self._gdn = _chunk_gated_delta_rule()
        self.flash_qla = _flash_qla(split=not invariant)
        if invariant and self.flash_qla is None:
            raise FastPathUnavailable("deterministic mode runs the delta rule on FlashQLA (Hopper or "
                                      "Blackwell, flash-qla installed, FLA_FLASH_QLA not 0); fla's kernels "
                                      "pick their configuration by timing in each process: run with "
                                      "--no-deterministic")
        self._varlen = _varlen_attn()
        # torch < 2.13 has no enable_gqa: the key/value heads are then repeated to the query heads.
        parameters = inspect.signature(self._varlen).parameters
        self._native_gqa = "enable_gqa" in parameters
        # Deterministic mode: never split a sequence's keys across blocks, whose number FlashAttention picks
        # from the pack (torch 2.11's FA2 splits only single-query GQA: ``attention`` keeps the pruned layer's
        # marker rows off that path where torch does not take num_splits).
        self._splits = {"num_splits": 1} if invariant and "num_splits" in parameters else {}
        self._invariant = invariant

    def variant_packs(self, heads: int, budget: int, longest: int = 0) -> dict[Any, list[int]]:
        """Packs (prompt lengths) that reach every delta-rule kernel variant: FlashQLA's (worker/fast/qla.py);
        through fla, packs of 1, 2, 4 ... 128 prompts."""
        if self.flash_qla is not None:
            return dict(self.flash_qla.variant_packs(heads, budget, longest))
        counts = [count for count in (2 ** i for i in range(8)) if count <= budget]
        return {f"fla, {count} prompts": [budget // count] * count for count in counts}

    def gated_delta(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
                    beta: torch.Tensor, bounds: Boundaries) -> torch.Tensor:
        if self.flash_qla is not None and self.flash_qla.supports(query, value):
            return self.flash_qla(query, key, value, decay, beta, bounds)
        out, _ = self._gdn(query[None], key[None], value[None], decay[None], beta[None], initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=bounds.cu_long,
                           cu_seqlens_cpu=bounds.cu_host, chunk_indices=bounds.chunk_index)
        return out[0]

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                  causal: bool, bounds: Boundaries, rows_only: bool = False) -> torch.Tensor:
        assert not (causal and rows_only), "marker-row queries need a noncausal layer"
        extra: dict[str, Any] = dict(self._splits)
        if query.shape[1] != key.shape[1]:
            if self._native_gqa:
                extra["enable_gqa"] = True
            else:
                groups = query.shape[1] // key.shape[1]
                key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        cu_q, max_q = (bounds.cu_rows, bounds.max_rows) if rows_only else (bounds.cu, bounds.max_length)
        if self._invariant:
            # The pruned layer's marker rows: a pack of one question per prompt has one query row each, and
            # FlashAttention then takes grouped heads as rows and splits the keys by how many prompts fill the
            # card. A bound of two keeps every pack on the path whose sums follow the prompt alone (rows past a
            # prompt's own are never read: the bound only sizes the grid).
            max_q = max(2, max_q)
        return self._varlen(query.contiguous(), key.contiguous(), value.contiguous(), cu_q, bounds.cu, max_q,
                            bounds.max_length, scale=scale,
                            window_size=(-1, 0) if causal else (-1, -1), **extra)


class TorchMixers:
    """The same two mixers one prompt at a time in plain torch (transformers' own delta rule, SDPA): the CPU
    stand-in the unit tests run the packed forward with."""

    def variant_packs(self, heads: int, budget: int, longest: int = 0) -> dict[Any, list[int]]:
        return {}  # nothing compiled per pack shape

    def gated_delta(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
                    beta: torch.Tensor, bounds: Boundaries) -> torch.Tensor:
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        cu = bounds.cu_host.tolist()
        out = torch.empty_like(value)
        for start, stop in zip(cu[:-1], cu[1:]):
            part = slice(start, stop)
            core, _ = torch_chunk_gated_delta_rule(query[None, part], key[None, part], value[None, part],
                                                   g=decay[None, part], beta=beta[None, part],
                                                   initial_state=None, output_final_state=False,
                                                   use_qk_l2norm_in_kernel=False)
            out[part] = core[0].to(out.dtype)
        return out

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                  causal: bool, bounds: Boundaries, rows_only: bool = False) -> torch.Tensor:
        cu = bounds.cu.tolist()
        cu_q = bounds.cu_rows.tolist() if rows_only else cu
        groups = query.shape[1] // key.shape[1]
        out = torch.empty_like(query)
        for prompt in range(len(cu) - 1):
            qs, ks = slice(cu_q[prompt], cu_q[prompt + 1]), slice(cu[prompt], cu[prompt + 1])
            prompt_query = query[qs].transpose(0, 1)[None]
            prompt_key, prompt_value = (tensor[ks].repeat_interleave(groups, dim=1).transpose(0, 1)[None]
                                        for tensor in (key, value))
            out[qs] = F.scaled_dot_product_attention(prompt_query, prompt_key, prompt_value, scale=scale,
                                                     is_causal=causal)[0].transpose(0, 1)
        return out
