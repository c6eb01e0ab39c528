"""FlashQLA's chunked gated delta rule called directly, and the packs that reach each of its compiled
variants.

Through fla, every layer call paid fla's dispatch, an autograd function and FlashQLA's own per-pack
preparation, which reads ``cu_seqlens`` back from the GPU (a host synchronisation per pack). Here that
preparation is done once per pack from the host copy of the boundaries, with FlashQLA's own helpers, so no
call waits for the GPU.

FlashQLA JIT-compiles a kernel variant per (split across the card or not, tile width of the main kernel) on
first use, 15-50 s each on an H200. Which variant a pack runs is FlashQLA's decision from the prompt lengths
and the number of value heads; ``variant_packs`` asks that decision over a family of packs (one long prompt
beside 0, 1, 2, 4 ... short ones, and 1, 2, 4 ... short ones alone) and keeps the smallest pack per variant,
so the engine warms every variant a pack of the shape can reach before it reports ready. At 32 value heads
(4B) one long prompt alone never splits, but beside three short ones it does: a list of pack shapes written by
hand missed that variant.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

if TYPE_CHECKING:
    from .layout import Boundaries


class Variant(NamedTuple):
    """One FlashQLA kernel variant: split across the card or not, and its tile width."""

    split: bool  # long prompts split across the card (kernels of its own)
    tile: int  # the main kernel's tile width (block_DV)

    def __str__(self) -> str:
        return f"{'split' if self.split else 'unsplit'}, tile {self.tile}"


def _doubling(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length())] if limit > 0 else []


class FlashQLA:
    """FlashQLA's chunked forward, its per-pack context (the intra-card split of long sequences, chunk offsets
    and indices) prepared on the host from ``Boundaries.cu_host`` instead of read back from the GPU."""

    def __init__(self, split: bool = True) -> None:
        """``split``: let FlashQLA split long prompts across the card where it decides to (off in
        deterministic mode: a prompt split or not, by what else is in its pack, sums its recurrence in another
        order)."""
        # Importing it raises on GPUs it has no kernels for (ValueError), as well as where it is missing.
        from flash_qla.ops.gated_delta_rule.chunk import CHUNK_SIZE, chunk_gated_delta_rule_fwd
        from flash_qla.ops.gated_delta_rule.chunk.cp import FlashQLACPContext, build_cp_context
        from flash_qla.utils.index import prepare_varlen_metadata

        self._chunk, self._forward, self._context_type = CHUNK_SIZE, chunk_gated_delta_rule_fwd, FlashQLACPContext
        self._build, self._attach = build_cp_context, prepare_varlen_metadata
        self.split = split
        self._pack: Boundaries | None = None
        self._context: Any = None

    @staticmethod
    def missing() -> str | None:
        """Why FlashQLA's kernels do not run here (not installed, no kernels for this GPU, or turned off by
        ``FLA_FLASH_QLA=0``, fla's switch for it), or None where they do."""
        if os.environ.get("FLA_FLASH_QLA", "1") == "0":
            return "FLA_FLASH_QLA=0 turns it off"
        try:  # what the constructor imports (the first raises ValueError on GPUs it has no kernels for)
            import flash_qla.ops.gated_delta_rule.chunk  # noqa: F401
            import flash_qla.ops.gated_delta_rule.chunk.cp  # noqa: F401
            import flash_qla.utils.index  # noqa: F401
        except (ImportError, ValueError) as error:
            return f"{type(error).__name__}: {error}"
        return None

    @staticmethod
    def takes(dtype: torch.dtype, head_k: int, head_v: int) -> bool:
        """FlashQLA's kernels: bf16 or fp16, 128-wide key and value heads."""
        return dtype in (torch.bfloat16, torch.float16) and head_k == head_v == 128

    @classmethod
    def supports(cls, query: torch.Tensor, value: torch.Tensor) -> bool:
        return cls.takes(query.dtype, query.shape[-1], value.shape[-1])

    def context(self, bounds: Boundaries, heads: int) -> Any:
        """The pack's context, built at its first layer (all layers of a pack share ``bounds``)."""
        if self._pack is bounds:
            return self._context
        # FlashQLA decides the split from the lengths alone; given host boundaries it builds host tensors.
        host = self._build(bounds.cu_host, enable_intra=self.split, num_v_heads=heads, chunk_size=self._chunk,
                           is_train=False)
        cu = self._attach(bounds.cu_long, bounds.cu_host)
        if not host.is_intra:
            context = self._context_type(cu_seqlens=cu)
        else:
            def device(tensor: torch.Tensor) -> torch.Tensor:
                return tensor.to(cu.device, non_blocking=True)

            split = self._attach(device(host.intra_cp_cu_seqlens), host.intra_cp_cu_seqlens)
            context = self._context_type(
                is_intra=True, cu_seqlens=cu, intra_cp_cu_seqlens=split, seq_map_r2c=device(host.seq_map_r2c),
                seq_map_c2r=device(host.seq_map_c2r), ht_mask=device(host.ht_mask),
                ht_mask_bwd=device(host.ht_mask_bwd))
        self._pack, self._context = bounds, context
        return context

    def variant(self, lengths: Sequence[int], heads: int) -> Variant:
        """The compiled kernels a pack of these prompt lengths runs: split across the card or not (the split
        adds kernels of its own), and the tile width the main kernel picks from its grid (sequences or split
        parts x heads against the card's size), read through FlashQLA's own cost model of that rule."""
        cu = torch.tensor([0, *itertools.accumulate(lengths)])
        host = self._build(cu, enable_intra=self.split, num_v_heads=heads, chunk_size=self._chunk, is_train=False)
        parts = len(host.intra_cp_cu_seqlens) - 1 if host.is_intra else len(lengths)
        return Variant(bool(host.is_intra), self._tile(parts, heads))

    @staticmethod
    def _tile(parts: int, heads: int) -> int:
        units = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        try:
            from flash_qla.ops.gated_delta_rule.chunk.cp.autocp import launch

            return launch.launch_config(launch.BACKEND_OF[launch.current_arch()], "fused_fwd",
                                        launch.LaunchShape(heads, parts, units)).block_DV
        # another version: every count below a full card
        except (ImportError, AttributeError, KeyError, ValueError):
            return min(parts, -(-units // heads))

    def variant_packs(self, heads: int, budget: int, longest: int = 0) -> dict[Variant, list[int]]:
        """The smallest pack (prompt lengths) found per variant, over packs of at most ``budget`` tokens and
        single prompts up to ``longest`` (a prompt over the budget runs alone). FlashQLA decides from chunk
        counts, so the lengths are whole chunks: one long prompt of every length beside 0, 1, 2, 4 ...
        one-chunk prompts, and 1, 2, 4 ... one-chunk prompts alone (about 2000 decisions for a 16k budget;
        with FlashQLA 0.1.3's cost model for an H200, a denser family and random packs found nothing more at 4
        to 64 heads)."""
        step, most = self._chunk, budget // self._chunk
        found: dict[Variant, list[int]] = {}

        def consider(lengths: list[int]) -> None:
            variant = self.variant(lengths, heads)
            if variant not in found or sum(lengths) < sum(found[variant]):
                found[variant] = lengths

        for count in _doubling(most):
            consider([step] * count)
        for chunks in range(2, most + 1):
            for count in [0, *_doubling(most - chunks)]:
                consider([step * chunks] + [step] * count)
        chunks = 2 * most
        while step * chunks < longest:  # over the budget: alone, in a one-off layout
            consider([step * chunks])
            chunks *= 2
        if longest > budget:
            consider([longest])
        return dict(sorted(found.items(), key=lambda item: sum(item[1])))

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
                 beta: torch.Tensor, bounds: Boundaries) -> torch.Tensor:
        context = self.context(bounds, value.shape[1])
        _, _, out, _, _, _ = self._forward(
            query[None], key[None], value[None], decay[None].contiguous(), beta[None].contiguous(),
            scale=query.shape[-1] ** -0.5, initial_state=None, cu_seqlens=context.cu_seqlens,
            output_final_state=False, cp_context=context, is_train=False)
        return out[0]
