"""Static token buckets: the dense pieces of every layer captured as CUDA graphs, replayed around eager
mixers.

A pack padded to bucket ``B`` runs: an eager prologue writes its embeddings and RoPE tables into static
buffers, then for every layer the graph of [previous layer's post piece + this layer's pre piece] replays and
the layer's mixer (fla delta rule or varlen attention, which need the prompt boundaries) runs eagerly on the
real tokens, writing its output back into a static buffer; a last graph applies the final piece and the head.

All buffers are allocated once at the largest bucket; a bucket's graphs use their leading rows, so every
bucket shares them. Graphs are captured largest bucket first into one memory pool: each piece's temporaries
are dead when it ends, so the pool holds only the largest piece's working set.

Rows past the pack's tokens (and marker rows past its rows) are inert. No real row reads them: every operation
of the pieces is row-local (GEMMs, norms, gates, per-token FP8 scales), the convolution reads only earlier
rows of the same prompt, the mixers see the real tokens only and the head reads marker rows only. And they
hold no stale values: the prologue zeroes their hidden state and, once per pack, the mixers' output buffers
past the real rows (the mixers write only those), so the tail computes the same values for every pack, from
zeros at position 0.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import layers
from .forward import ROWS, PackedForward, compile_piece
from .layers import FULL, LINEAR
from .layout import Boundaries, row_capacity
from .ops import Ops

Capture = Callable[[Callable[[], None]], Callable[[], None]]


def _write(outs: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    for out, value in zip(outs, values, strict=True):
        out.copy_(value)


# The pieces in "into" form: outputs are written into static buffers (compiled, the copies fuse into the
# kernels that produce them).
def pre_linear_into(ops: Ops, dims: Any, weights: Any, hidden: torch.Tensor, seqpos: torch.Tensor,
                    *outs: torch.Tensor) -> None:
    layers.pre_linear(ops, dims, weights, hidden, seqpos, outs)  # the short convolution writes into outs


def post_linear_into(ops: Ops, dims: Any, weights: Any, hidden: torch.Tensor, mixed: torch.Tensor,
                     out_gate: torch.Tensor) -> None:
    hidden.copy_(layers.post_linear(ops, dims, weights, hidden, mixed, out_gate))


def pre_full_into(ops: Ops, dims: Any, weights: Any, hidden: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, *outs: torch.Tensor) -> None:
    _write(outs, layers.pre_full(ops, dims, weights, hidden, cos, sin))


def pre_full_rows_into(ops: Ops, dims: Any, weights: Any, hidden: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, rows: torch.Tensor, *outs: torch.Tensor) -> None:
    _write(outs, layers.pre_full_rows(ops, dims, weights, hidden, cos, sin, rows))


def post_full_into(ops: Ops, dims: Any, weights: Any, hidden: torch.Tensor, mixed: torch.Tensor,
                   gate: torch.Tensor) -> None:
    hidden.copy_(layers.post_full(ops, dims, weights, hidden, mixed, gate))


def final_into(ops: Ops, _dims: None, head: Any, hidden: torch.Tensor, scores: torch.Tensor) -> None:
    scores.copy_(layers.final(ops, head, hidden))


def final_rows_into(ops: Ops, _dims: None, head: Any, hidden: torch.Tensor, rows: torch.Tensor,
                    scores: torch.Tensor) -> None:
    scores.copy_(layers.final(ops, head, hidden[rows]))


INTO = (pre_linear_into, post_linear_into, pre_full_into, pre_full_rows_into, post_full_into, final_into,
        final_rows_into)


class Workspace:
    """Static device buffers sized for ``capacity`` token rows and ``rows`` marker rows."""

    def __init__(self, fwd: PackedForward, capacity: int, rows: int, verbalizers: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        def zeros(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(*shape, dtype=kind, device=device)  # zeros: inert rows stay finite

        self.capacity, self.rows = capacity, rows
        hidden = fwd.hidden_size
        self.h = zeros(capacity, hidden)
        self.cos = self.sin = None
        lin = next((s.dims for s in fwd.stages if s.kind == LINEAR), None)
        full = next((s.dims for s in fwd.stages if s.kind != LINEAR), None)
        if lin is not None:
            self.lq, self.lk = (zeros(capacity, lin.k_heads, lin.head_k) for _ in range(2))
            self.lv, self.lo = (zeros(capacity, lin.v_heads, lin.head_v) for _ in range(2))
            self.g, self.beta = zeros(capacity, lin.v_heads, kind=torch.float32), zeros(capacity, lin.v_heads)
            self.z = zeros(capacity, lin.value_dim)
        if full is not None:
            self.fq, self.fo = (zeros(capacity, full.heads, full.head_dim) for _ in range(2))
            self.fk, self.fv = (zeros(capacity, full.kv_heads, full.head_dim) for _ in range(2))
            self.gate = zeros(capacity, full.heads * full.head_dim)
            if fwd.pruned:  # the pruned last layer's marker rows
                self.rq, self.ro = (zeros(rows, full.heads, full.head_dim) for _ in range(2))
                self.rgate, self.rh = zeros(rows, full.heads * full.head_dim), zeros(rows, hidden)
            rotary = fwd.rotary.inv_freq.shape[0] * 2
            self.cos, self.sin = zeros(capacity, rotary), zeros(capacity, rotary)
        self.scores = zeros(rows, verbalizers, kind=torch.float32)


def _tokens_symbolic(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` called with the first dimension (tokens, or marker rows) of its tensor arguments symbolic: one
    compiled graph for every bucket, hence one kernel and one configuration per operation."""

    def call(*args: Any) -> None:
        for arg in args:
            if isinstance(arg, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(arg, 0)
        return fn(*args)

    return call


class GraphedForward:
    """Capture and replay of one PackedForward's pieces for a fixed list of buckets."""

    def __init__(self, fwd: PackedForward, workspace: Workspace, compile_layers: bool,
                 invariant: bool = False) -> None:
        """A bucket computes ``row_capacity(bucket)`` marker rows. ``invariant`` (deterministic mode): the compiled
        pieces take the token count as a symbol, so that every bucket runs the same kernels
        (worker/fast/deterministic.py)."""
        self.fwd, self.ws = fwd, workspace
        # Static shapes: one compiled graph per bucket, so inductor's kernels know every size and alignment
        # (vectorised loads, persistent reductions). With symbolic sizes the same pieces ran 2.8x slower on an
        # H200 (49.5 against 17.4 ms of element-wise kernels per 16k-token 2B pack); invariant pieces keep the
        # feature sizes static and make only the token count a symbol.
        into = list(INTO)
        if compile_layers:
            into = [compile_piece(fn, inline=fn is pre_linear_into, dynamic=None if invariant else False)
                    for fn in INTO]
            if invariant:
                into = [_tokens_symbolic(fn) for fn in into]
        (self.pre_linear, self.post_linear, self.pre_full, self.pre_full_rows, self.post_full, self.final,
         self.final_rows) = into
        self.graphs: dict[int, list[Callable[[], None]]] = {}

    def pieces(self, bucket: int, seqpos: torch.Tensor, rows: torch.Tensor) -> list[Callable[[], None]]:
        """Piece n = post of stage n - 1 (if any) + pre of stage n; the last piece ends with the head."""
        ws, fwd, ops = self.ws, self.fwd, self.fwd.ops
        cap, rcap = bucket, row_capacity(bucket)
        assert cap <= ws.capacity and rcap <= ws.rows and seqpos.shape[0] == cap and rows.shape[0] == rcap
        hidden = ws.h[:cap]

        def post(stage: Any) -> None:
            dims, weights = stage.dims, stage.weights
            if stage.kind == LINEAR:
                self.post_linear(ops, dims, weights, hidden, ws.lo[:cap], ws.z[:cap])
            elif stage.kind == FULL:
                self.post_full(ops, dims, weights, hidden, ws.fo[:cap], ws.gate[:cap])
            else:
                self.post_full(ops, dims, weights, ws.rh[:rcap], ws.ro[:rcap], ws.rgate[:rcap])

        def pre(stage: Any) -> None:
            dims, weights = stage.dims, stage.weights
            if stage.kind == LINEAR:
                self.pre_linear(ops, dims, weights, hidden, seqpos, ws.lq[:cap], ws.lk[:cap], ws.lv[:cap],
                                ws.g[:cap], ws.beta[:cap], ws.z[:cap])
            elif stage.kind == FULL:
                self.pre_full(ops, dims, weights, hidden, ws.cos[:cap], ws.sin[:cap], ws.fq[:cap],
                              ws.fk[:cap], ws.fv[:cap], ws.gate[:cap])
            else:
                self.pre_full_rows(ops, dims, weights, hidden, ws.cos[:cap], ws.sin[:cap], rows, ws.rq[:rcap],
                                   ws.fk[:cap], ws.fv[:cap], ws.rgate[:rcap], ws.rh[:rcap])

        def head() -> None:
            if fwd.pruned:
                self.final(ops, None, fwd.head, ws.rh[:rcap], ws.scores[:rcap])
            else:
                self.final_rows(ops, None, fwd.head, hidden, rows, ws.scores[:rcap])

        stages = fwd.stages
        out: list[Callable[[], None]] = []
        for index in range(len(stages) + 1):
            before = stages[index - 1] if index > 0 else None
            after = stages[index] if index < len(stages) else None

            def piece(before: Any = before, after: Any = after) -> None:
                if before is not None:
                    post(before)
                if after is not None:
                    pre(after)
                else:
                    head()

            out.append(piece)
        return out

    def capture(self, buckets: Sequence[int], inputs: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                capture: Capture, warm: Callable[[Callable[[], None]], None],
                log: logging.Logger | None = None
                ) -> None:
        """Largest bucket first. ``inputs(bucket)`` gives its static seqpos and rows views; ``warm`` runs a
        piece once before capture (compilation and lazy library set-up must not happen inside a capture).
        ``log``: each bucket's time (compilation makes the first one long on a cold machine)."""
        order = sorted(buckets, reverse=True)
        for number, bucket in enumerate(order, 1):
            began = time.perf_counter()
            pieces = self.pieces(bucket, *inputs(bucket))
            for piece in pieces:
                warm(piece)
            compiled = time.perf_counter() - began
            self.graphs[bucket] = [capture(piece) for piece in pieces]
            if log is not None:
                log.info("warm-up: bucket %d (%d of %d): %d pieces compiled and run in %.1fs, captured in "
                         "%.1fs", bucket, number, len(order), len(pieces), compiled,
                         time.perf_counter() - began - compiled)

    def prologue(self, bucket: int, hidden: torch.Tensor, positions: torch.Tensor, rows: int) -> None:
        """Embeddings of the real tokens into the static hidden state and RoPE tables for the bucket's rows;
        inert rows zeroed (see above). ``positions``: (3, bucket), the tail at 0; ``rows``: the real marker
        rows."""
        ws, tokens = self.ws, hidden.shape[0]
        ws.h[:tokens].copy_(hidden)
        ws.h[tokens:bucket].zero_()
        for out in (getattr(ws, "lo", None), getattr(ws, "fo", None)):
            if out is not None:
                out[tokens:bucket].zero_()
        if getattr(ws, "ro", None) is not None:
            ws.ro[rows: row_capacity(bucket)].zero_()
        if ws.cos is not None:
            cos, sin = self.fwd.rope_tables(positions, hidden)
            ws.cos[:bucket].copy_(cos)
            ws.sin[:bucket].copy_(sin)

    def replay(self, bucket: int, tokens: int, rows: int, bounds: Boundaries) -> torch.Tensor:
        """After ``prologue``: the pack's head scores, (row capacity, verbalizers) fp32, the first ``rows``
        real."""
        ws, fwd, mix = self.ws, self.fwd, self.fwd.mixers
        graphs = self.graphs[bucket]
        real = slice(0, tokens)  # the pack's tokens; the mixers never see the bucket's inert tail
        for stage, graph in zip(fwd.stages, graphs):
            graph()
            dims = stage.dims
            if stage.kind == LINEAR:
                ws.lo[real].copy_(mix.gated_delta(ws.lq[real], ws.lk[real], ws.lv[real], ws.g[real],
                                                  ws.beta[real], bounds))
            elif stage.kind == FULL:
                ws.fo[real].copy_(mix.attention(ws.fq[real], ws.fk[real], ws.fv[real], dims.scale,
                                                fwd.causal, bounds))
            else:
                assert stage.kind == ROWS
                ws.ro[:rows].copy_(mix.attention(ws.rq[:rows], ws.fk[real], ws.fv[real], dims.scale,
                                                 False, bounds, rows_only=True))
        graphs[-1]()
        return ws.scores[: row_capacity(bucket)]


def cuda_capture(pool: Any) -> Capture:
    """Capture a piece into a CUDA graph in the shared ``pool``; returns its replay."""

    def capture(piece: Callable[[], None]) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            piece()
        return graph.replay

    return capture


def cuda_warmer() -> Callable[[Callable[[], None]], None]:
    """Runs a piece once on a side stream, as CUDA graph capture requires of first calls. One stream for every
    piece: memory cached for a stream serves only that stream, so a stream per piece would hoard each piece's
    temporaries."""
    stream = torch.cuda.Stream()

    def warm(piece: Callable[[], None]) -> None:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            piece()
        torch.cuda.current_stream().wait_stream(stream)

    return warm
