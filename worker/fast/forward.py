"""The packed forward of a loaded checkpoint: embedding (and image features), the decoder stages, the head.

``PackedForward`` owns the per-layer weights (read from the checkpoint's modules, fused, optionally FP8), the
dense pieces (plain, or compiled per sub-module or per piece), and the eager path: one call per piece, shapes
as the pack has them. The graphed path (worker/fast/graphs.py) replays the same pieces from static buffers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from ..fast_options import COMPILE_MODES, chosen_epilogues, chosen_families
from ..model.checkpoint import DecisionModel
from . import fp8 as fp8_weights
from . import layers
from .layers import FULL, LINEAR
from .layout import Boundaries
from .mixers import Mixers
from .ops import Ops

ROWS = "rows"  # the pruned last layer: queries, output and MLP at marker rows only
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stage:
    """One decoder layer as the packed forward runs it: its kind, fused weights and dimensions."""

    kind: str  # LINEAR, FULL or ROWS
    weights: Any  # layers.LinearAttn or layers.FullAttn
    dims: Any  # layers.LinearDims or layers.FullDims


class Pieces(NamedTuple):
    """The dense pieces, all called as ``fn(ops, dims, weights, *activations)``."""

    pre_linear: Callable[..., Any]
    post_linear: Callable[..., Any]
    pre_full: Callable[..., Any]
    pre_full_rows: Callable[..., Any]
    post_full: Callable[..., Any]
    final: Callable[..., Any]


def _final(ops: Ops, _dims: None, head: layers.Head, hidden: torch.Tensor) -> torch.Tensor:
    return layers.final(ops, head, hidden)


PLAIN = Pieces(layers.pre_linear, layers.post_linear, layers.pre_full, layers.pre_full_rows, layers.post_full,
               _final)


# The pre piece of a linear-attention layer: its convolution reads a dozen inputs per output and silu uses the
# result twice, which makes inductor store the convolution in fp32 and read it back; inlining it instead keeps
# the whole piece at one read of the projections and one write per output (it was a quarter of the 2B model's
# time).
INLINE_CONV = {"realize_reads_threshold": 64, "realize_opcount_threshold": 400,
               "realize_acc_reads_threshold": 64}


def compile_piece(fn: Callable[..., Any], inline: bool = False,
                  dynamic: bool | None = True) -> Callable[..., Any]:
    """torch.compile of one piece, shared by every layer of its kind: weights are arguments, so one compiled
    graph serves all layers. ``dynamic``: True, every dimension symbolic, one graph for every pack length;
    False, one graph per shape (the buckets), whose kernels know every size and alignment; None, the sizes the
    caller marks symbolic (worker/fast/graphs.py)."""
    import torch._inductor.config as inductor_config

    options = {k: v for k, v in INLINE_CONV.items() if inline and hasattr(inductor_config, k)}
    return torch.compile(fn, dynamic=dynamic, options=options or None)


def configure_compile() -> None:
    """Process-wide dynamo settings for the pieces. Without duck shaping, dimensions that happen to be equal
    in one model (hidden size and key width, say) get separate symbols, so the graphs stay valid for the next
    model."""
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = False
    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, 64)
    config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, 512)


class PackedForward:
    """A loaded checkpoint's forward over packs: per-layer weights, the dense pieces and the eager path."""

    def __init__(self, model: DecisionModel, mixers: Mixers, *, prune_last: bool = True, fp8: bool = False,
                 fp8_layers: str = "all", fp8_matrices: str = "all", compile: str = "none",
                 compile_pieces: bool = True, fused: bool = False, image_by_image: bool = False,
                 epilogues: str = "", deterministic: bool = False) -> None:
        """``fp8_layers``, ``fp8_matrices``: which layers and families of matrices ``fp8`` converts
        (worker/fast/fp8.py: chosen_layers; worker/fast_options.py: chosen_families). ``compile_pieces``:
        with ``compile="layer"``, also compile the eager pieces (off when the pieces run from CUDA graphs,
        which compile their own variants). ``fused``: the project's Triton kernels (worker/fast/fused.py)
        where they apply. ``image_by_image``: the vision tower runs each image alone (deterministic mode).
        ``epilogues``: the opt-in kernels of worker/fast/epilogues.py (``chosen_epilogues``), with ``fused``
        only; ``deterministic``: deterministic mode (their GEMM runs one configuration for every token
        count)."""
        assert compile in COMPILE_MODES, f"compile must be one of {COMPILE_MODES}, got {compile!r}"
        self.model, self.mixers, self.image_by_image = model, mixers, image_by_image
        lm = model.language_model
        self.embed_tokens, self.rotary = lm.embed_tokens, lm.rotary_emb
        self.causal = not model.noncausal
        config = model.text_config
        assert getattr(config, "hidden_act", "silu") in ("silu", "swish"), "Qwen3.5's MLP is SwiGLU"
        self.stages: list[Stage] = []
        chosen = fp8_weights.chosen_layers(fp8_layers, [layer.block_type
                                                        for layer in lm.layers]) if fp8 else set()
        families = chosen_families(fp8_matrices)
        for index, layer in enumerate(lm.layers):
            weights, dims = (layers.linear_layer(layer) if layer.block_type == LINEAR
                             else layers.full_layer(layer))
            if index in chosen:
                weights = fp8_weights.convert(weights, families)
            self.stages.append(Stage(layer.block_type, weights, dims))
        # Pruning the last layer is exact only when a marker row sees all keys of its prompt (noncausal).
        self.pruned = prune_last and not self.causal and self.stages[-1].kind == FULL
        if self.pruned:
            last = self.stages[-1]
            self.stages[-1] = Stage(ROWS, last.weights, last.dims)
        self.head = layers.head_weights(lm, model.model.proj, model.softcap)
        self.fp8_matrices = sum(fp8_weights.count(stage.weights) for stage in self.stages)
        if compile != "none":
            configure_compile()
        self.ops = Ops().compiled() if compile == "sub" else Ops()
        self.fused = fused
        chosen = chosen_epilogues(epilogues)
        self.epilogues = chosen if fused else frozenset()
        if chosen and not fused:  # said once, at start-up, rather than dropped in silence
            log.info("--epilogues %s not applied: they run with the fused kernels only (--fused-kernels, a "
                     "bf16 or fp16 model on CUDA)", ",".join(sorted(chosen)))
        if fused:
            from .fused import fused_ops  # Triton: imported only where it runs

            self.ops = fused_ops(self.ops)
        if self.epilogues:
            from .epilogues import epilogue_ops

            self.ops = epilogue_ops(self.ops, model.device, deterministic=deterministic,
                                    **{name: True for name in self.epilogues})
        self.pieces = PLAIN
        if compile == "layer" and compile_pieces:
            self.pieces = Pieces(*(compile_piece(fn, inline=fn is layers.pre_linear) for fn in PLAIN))
        self.image_token_id = getattr(model.backbone.config, "image_token_id", None)

    @property
    def hidden_size(self) -> int:
        return int(self.embed_tokens.weight.shape[1])

    # ---- prologue (eager in both paths) ----

    def embed(self, ids: torch.Tensor, image_rows: torch.Tensor | None = None,
              pixel_values: torch.Tensor | None = None, grid: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings, with the vision tower's features written at the image tokens (rows of the
        pack)."""
        hidden = self.embed_tokens(ids)
        if pixel_values is not None:
            assert image_rows is not None and grid is not None
            patches = grid.prod(-1).tolist()  # the host's grid: no wait for the GPU
            pixels, grid = pixel_values.to(hidden.device, self.model.dtype), grid.to(hidden.device)
            parts: Any = [(pixels, grid)]
            if self.image_by_image:  # each image in shapes of its own, whatever else the pack holds
                parts = zip(pixels.split(patches), grid.split(1))
            features = torch.cat([feature for part, part_grid in parts for feature in self.model.backbone
                                  .get_image_features(part, part_grid, return_dict=True).pooler_output])
            features = features.to(hidden.dtype)
            assert features.shape[0] == image_rows.shape[0], "one feature per image token"
            hidden = hidden.index_copy(0, image_rows, features)
        return hidden

    def rope_tables(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(3, T) M-RoPE positions -> cos, sin (T, rotary_dim): the backbone's own rotary embedding."""
        cos, sin = self.rotary(like, positions[:, None, :])
        return cos[0], sin[0]

    # ---- the eager path ----

    def run(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqpos: torch.Tensor,
            rows: torch.Tensor, bounds: Boundaries) -> torch.Tensor:
        """(T, hidden) embeddings -> (rows, verbalizers) fp32 head scores at the marker ``rows``."""
        pieces, ops, mix = self.pieces, self.ops, self.mixers
        for stage in self.stages:
            dims, weights = stage.dims, stage.weights
            if stage.kind == LINEAR:
                query, key, value, decay, beta, out_gate = pieces.pre_linear(ops, dims, weights, hidden, seqpos)
                mixed = mix.gated_delta(query.contiguous(), key.contiguous(), value.contiguous(), decay, beta, bounds)
                hidden = pieces.post_linear(ops, dims, weights, hidden, mixed, out_gate)
            elif stage.kind == FULL:
                query, key, value, gate = pieces.pre_full(ops, dims, weights, hidden, cos, sin)
                mixed = mix.attention(query, key, value, dims.scale, self.causal, bounds)
                hidden = pieces.post_full(ops, dims, weights, hidden, mixed, gate)
            else:
                query, key, value, gate, hidden = pieces.pre_full_rows(ops, dims, weights, hidden, cos, sin, rows)
                mixed = mix.attention(query, key, value, dims.scale, False, bounds, rows_only=True)
                hidden = pieces.post_full(ops, dims, weights, hidden, mixed, gate)
        if not self.pruned:
            hidden = hidden[rows]
        return pieces.final(ops, None, self.head, hidden)
