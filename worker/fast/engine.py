"""The fast engine: packs of prompts through one padding-free forward, optionally compiled and CUDA-graphed.

``launch`` lays the pack out on the host (worker/fast/layout.py), moves it with one copy from a pinned buffer into a
persistent device buffer, runs the forward (eager, or the graphs of the smallest bucket that holds the pack) and
enqueues the copy of the head scores into pinned memory; it returns without waiting for the GPU. ``Pending.wait``
waits for that copy. Two staging slots alternate, so the caller can form and launch the next pack while one runs;
a slot is reused only after its pack has finished.

Nothing in a launch waits for the GPU (FlashQLA's per-pack context comes from the host boundaries, see
worker/fast/mixers.py) except a slot's reuse, which waits for the pack launched two before.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers.decision import Question

from ..config import Settings
from ..model.checkpoint import DecisionModel
from ..model.engine import Prompt, PackRun, Pending
from .errors import ALTERNATIVE, FastPathUnavailable
from .forward import COMPILE_MODES, PackedForward
from .layers import LINEAR, LinearDims
from .graphs import Capture, GraphedForward, Workspace, cuda_capture, cuda_warmer
from .layout import Boundaries, Layout, Regions, lay_out, prompt_positions, row_capacity
from . import invariant, prebuild
from .mixers import CudaMixers, Mixers
from .qla import FlashQLA

log = logging.getLogger(__name__)
SLOTS = 2
WARMUP = Question(name="warmup", type="noul", instructions=None, options=["false", "true"], labels=["A", "B"],
                  descriptions=[None, None])  # the warm-up's prompts ask this
CACHES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton", "TILELANG_CACHE_DIR": "tilelang"}


def use_compile_cache(path: str) -> None:
    """Inductor's, Triton's and TileLang's caches under one directory (``compile_cache``): a worker that finds them
    there from an earlier start skips compiling. Set before the first compilation (they read these at use)."""
    for variable, name in CACHES.items():
        os.environ[variable] = os.path.join(os.path.abspath(path), name)
        os.makedirs(os.environ[variable], exist_ok=True)


@dataclass
class _Slot:
    """Host side of one in-flight pack: its pinned layout buffer and pinned score rows."""

    host: torch.Tensor  # (regions.size,) int64
    scores: torch.Tensor  # (rows capacity, verbalizers) fp32
    pending: Pending | None = None


class FastEngine:
    name = "fast"

    def __init__(self, model: DecisionModel, settings: Settings, mixers: Mixers | None = None,
                 capture: tuple[Capture, Callable[[Callable[[], None]], None]] | None = None) -> None:
        """``mixers``: the eager token mixers; CUDA's (fla + varlen attention) unless a test passes a stand-in.
        ``capture``: how pieces are captured and warmed; CUDA graphs unless a test passes a plain-call stand-in
        (which runs the bucketed path's static buffers on any device)."""
        if settings.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {settings.compile!r}")
        if settings.compile_cache:
            use_compile_cache(settings.compile_cache)  # before anything compiles or imports TileLang
        # Deterministic mode: the same kernels, in the same order of sums, for a row whatever its pack
        # (worker/fast/invariant.py).
        self.invariant = settings.deterministic
        if self.invariant:
            invariant.enable()
        if mixers is None:
            if model.device.type != "cuda":
                raise FastPathUnavailable(f"the fast engine runs on CUDA; this model is on {model.device}: "
                                          f"load it on a GPU (--device cuda), or {ALTERNATIVE}")
            mixers = CudaMixers(invariant=self.invariant)
        self.device = model.device
        self.graphs_on = settings.cuda_graphs and (self.device.type == "cuda" or capture is not None)
        self._capture_with = capture
        if settings.fp8:
            from .fp8 import require_fp8

            require_fp8(self.device)
        self.buckets = settings.bucket_sizes if self.graphs_on else ()
        if self.graphs_on and not self.buckets:
            raise ValueError("cuda_graphs needs at least one bucket size (--buckets)")
        self._budget = max(self.buckets) if self.buckets else settings.pack_tokens
        if self._budget < 1:
            raise ValueError("the pack budget must be positive")
        self.model, self.settings = model, settings
        self.pad_id = model.pad_id
        fused = settings.fused_kernels and self.device.type == "cuda" and model.dtype in (torch.bfloat16,
                                                                                         torch.float16)
        # Deterministic mode computes the head at every row of the bucket: one row count per bucket, and no pack
        # sent down the eager path for having more questions than a pruned layer's rows.
        self.rows_of = (lambda bucket: bucket) if self.invariant else row_capacity
        self.fwd = PackedForward(model, mixers, prune_last=settings.prune_last and not self.invariant,
                                 fp8=settings.fp8, fp8_layers=settings.fp8_layers, fp8_matrices=settings.fp8_matrices,
                                 compile=settings.compile, compile_pieces=not self.graphs_on, fused=fused,
                                 image_by_image=self.invariant, epilogues=settings.epilogues, invariant=self.invariant)
        linear = self.linear_dims = next((stage.dims for stage in self.fwd.stages if stage.kind == LINEAR), None)
        # Where the delta rule runs on FlashQLA (else on fla's kernels, or the stand-in mixers).
        self.on_flash_qla = (linear is not None and getattr(mixers, "flash_qla", None) is not None
                             and FlashQLA.takes(model.dtype, linear.head_k, linear.head_v))
        if self.invariant and isinstance(mixers, CudaMixers) and linear is not None and not self.on_flash_qla:
            # fla's kernels pick their configuration by timing, per process.
            raise ValueError(f"deterministic mode runs the delta rule on FlashQLA, which takes bf16 or fp16 and "
                             f"128-wide heads; this model is {model.dtype} with {linear.head_k}-wide heads")
        if self.invariant and self.device.type == "cuda" and not (self.graphs_on and settings.compile == "layer"):
            # Eager packs run each length's own kernels (and their own reduction orders): only the graphed,
            # compiled pieces are built to be the same for every bucket.
            raise ValueError(f"deterministic mode runs packs from CUDA graphs of compiled layers (--cuda-graphs, "
                             f"--compile layer); here cuda_graphs={settings.cuda_graphs}, compile={settings.compile}")
        self.rope_index = getattr(model.backbone, "get_rope_index", None) if model.multimodal else None
        self.verbalizers = int(model.model.proj.out_features)
        # Host and device layout buffers: large enough for a full pack or the longest prompt the encoder makes.
        self.regions = Regions.for_capacity(max(self._budget, settings.max_prompt_tokens))
        pin = self.device.type == "cuda"
        self.slots = [_Slot(torch.zeros(self.regions.size, dtype=torch.int64, pin_memory=pin),
                            torch.zeros(self.regions.capacity, self.verbalizers, dtype=torch.float32,
                                        pin_memory=pin)) for _ in range(SLOTS)]
        self.device_layout = torch.zeros(self.regions.size, dtype=torch.int64, device=self.device)
        self._next = 0
        self._last_done: torch.cuda.Event | None = None  # the previous pack's end on the GPU (idle time)
        self.graphed: GraphedForward | None = None
        self.compile_seconds = self.capture_seconds = 0.0

    @property
    def max_pack_tokens(self) -> int:
        return self._budget

    # ---- start-up ----

    def warmup(self) -> None:
        """Capture every bucket's graphs (largest first, one pool), then run a pack through each path so that
        compilation and the mixers' JIT happen now rather than on the first request. Each stage is logged as it
        goes (minutes on a cold machine)."""
        start = time.perf_counter()
        if self.invariant and self.device.type == "cuda":
            linears = [linear for stage in self.fwd.stages for linear in invariant.linears_of(stage.weights)]
            checked = invariant.check_gemms([*linears, self.fwd.head.proj], self.buckets, self.model.dtype)
            log.info("deterministic mode: %d GEMMs give every row the same bits at buckets %s (%.1fs)", checked,
                     self.buckets, time.perf_counter() - start)
        # The delta rule's kernels come in variants (FlashQLA: split across the card or not, and the tile width its
        # grid size picks), each JIT-compiled on first use (15-50 s on an H200): one pack for each variant that
        # any pack of at most the budget, or one prompt up to the longest, can reach (worker/fast/qla.py). Child
        # processes compile them beside the capture (worker/fast/prebuild.py); the packs below then load them.
        dims = self.linear_dims
        heads = dims.v_heads if dims is not None else 0
        longest = max(self.model.max_length, self._budget)
        variants = self.fwd.mixers.variant_packs(heads, self._budget, longest) if heads else {}
        log.info("warm-up: %d delta-rule variants at %d value heads (decided in %.1fs): %s", len(variants), heads,
                 time.perf_counter() - start, "; ".join(f"{v}: {len(p)} prompts, {sum(p)} tokens"
                                                        for v, p in variants.items()))
        children = self._prebuild(variants, dims)
        log.info("warm-up: compiling and capturing buckets %s (compile %s)", self.buckets or "-", self.settings.compile)
        with torch.inference_mode():  # as the packs run: compiled guards include the grad mode
            self._capture()
        self.capture_seconds = time.perf_counter() - start
        if children is not None:
            children.join(log)
        sizes = self.buckets or (min(512, self._budget), self._budget)
        for size in sizes:  # every bucket's graphs replayed once (their first launch uploads them)
            self._timed(f"first pack of bucket {size}", [size // 2, size - size // 2])
        for number, (variant, lengths) in enumerate(variants.items(), 1):
            self._timed(f"delta-rule variant {number} of {len(variants)} ({variant})", lengths)
        if self.invariant:
            self._check_invariance()
        self.compile_seconds = time.perf_counter() - start - self.capture_seconds
        log.info("fast engine ready: buckets %s, compile %s, graphs %s, prune %s, fp8 %s (%d matrices, layers %s, %s), "
                 "fused kernels %s (epilogues %s); capture %.1fs, first packs %.1fs (%d delta-rule variants)",
                 self.buckets or "-", self.settings.compile, self.graphs_on, self.fwd.pruned, self.settings.fp8,
                 self.fwd.fp8_matrices, self.settings.fp8_layers, self.settings.fp8_matrices, self.fwd.fused,
                 ",".join(sorted(self.fwd.epilogues)) or "none", self.capture_seconds, self.compile_seconds,
                 len(variants))

    def _check_invariance(self) -> None:
        """Deterministic mode keeps its promise on this card and software before the worker reports ready: probe
        prompts of random tokens alone, then first and last in packs that fill every bucket, beside one filler or
        many short ones (the delta rule's widest tile, where alone it takes its narrowest), must score the same
        bits."""
        began, checked = time.perf_counter(), 0
        generator = torch.Generator().manual_seed(0)
        tokenizer = getattr(self.model, "tokenizer", None)
        vocab = int(self.fwd.embed_tokens.weight.shape[0])
        vocab = min(vocab, len(tokenizer)) if tokenizer is not None else vocab  # ids a request can hold
        image = self.fwd.image_token_id

        def probe(length: int) -> Prompt:
            ids = torch.randint(0, vocab, (length,), generator=generator)
            if image is not None:
                ids[ids == image] = self.pad_id
            return Prompt(input_ids=ids, rows=torch.tensor([length // 2, length - 1]), questions=(WARMUP, WARMUP))

        buckets = self.buckets or (self._budget,)
        smallest = min(buckets)
        for length in sorted({max(2, min(37, smallest // 2)), max(2, smallest // 3)}):
            target = probe(length)
            alone = self.launch([target]).wait().scores[0]
            for bucket in buckets:
                room = bucket - length  # fillers fill the bucket exactly
                if room < 2:
                    continue
                short = min(32, room // 64 - 1)  # enough prompts to fill the card's grid, and one long
                for fillers in [[room]] + ([[64] * short + [room - 64 * short]] if short > 0 else []):
                    crowd = [probe(n) for n in fillers]
                    for pack, at in (([target, *crowd], 0), ([*crowd, target], len(crowd))):
                        run = self.launch(pack).wait()
                        assert run.bucket == (bucket if self.buckets else None), (run.bucket, bucket)
                        got, checked = run.scores[at], checked + 1
                        if not torch.equal(got.view(torch.int32), alone.view(torch.int32)):  # bits, NaN included
                            raise invariant.NotInvariant(
                                f"deterministic mode's check at warm-up: a {length}-token probe prompt scored other "
                                f"bits {'first' if at == 0 else 'last'} in a pack of {len(pack)} prompts (bucket "
                                f"{bucket}) than alone, up to {(got - alone).abs().max().item():g} apart, on this "
                                f"card and software: run without --deterministic")
        if not checked:
            raise invariant.NotInvariant(f"deterministic mode's check at warm-up found no pack to check: the buckets "
                                         f"{buckets} are too small (at least 4 tokens)")
        log.info("deterministic mode: %d probe packs scored their probe prompts bitwise as alone (%.1fs)", checked,
                 time.perf_counter() - began)

    def _prebuild(self, variants: dict, dims: LinearDims | None) -> prebuild.Prebuild | None:
        """Children compiling FlashQLA's variants, where the delta rule runs on FlashQLA (CUDA, 128-wide heads)."""
        if not variants or dims is None or not self.on_flash_qla:
            return None
        return prebuild.start(variants, dims.k_heads, dims.v_heads, 128, 128,
                              str(self.model.dtype).removeprefix("torch."))

    def _timed(self, what: str, lengths: Sequence[int]) -> None:
        """One warm-up pack, run to completion and logged with its time."""
        began = time.perf_counter()
        self.launch(self._dummy_pack(lengths)).wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        log.info("warm-up: %s, %d tokens: %.1fs", what, sum(lengths), time.perf_counter() - began)

    def _capture(self) -> None:
        if self.graphs_on:
            ws = Workspace(self.fwd, max(self.buckets), self.rows_of(max(self.buckets)), self.verbalizers,
                           self.device, self.model.dtype)
            self.graphed = GraphedForward(self.fwd, ws, compile_layers=self.settings.compile == "layer",
                                          rows_of=self.rows_of, invariant=self.invariant)
            capture, warm = self._capture_with or (cuda_capture(torch.cuda.graph_pool_handle()), cuda_warmer())
            self.graphed.capture(self.buckets, self._static_inputs, capture, warm, log=log)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the warm-up stream's cached blocks; the graphs keep their pool

    def _static_inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        regions = self.regions
        return (self.device_layout[regions.seqpos: regions.seqpos + bucket],
                self.device_layout[regions.rows: regions.rows + self.rows_of(bucket)])

    def _dummy_pack(self, lengths: Sequence[int]) -> list[Prompt]:
        """Prompts of padding of these lengths, one marker each."""
        return [Prompt(input_ids=torch.full((n,), self.pad_id, dtype=torch.long), rows=torch.tensor([n - 1]),
                      questions=(WARMUP,)) for n in lengths if n > 0]

    # ---- packs ----

    @torch.inference_mode()
    def launch(self, prompts: Sequence[Prompt]) -> Pending:
        start = time.perf_counter()
        assert prompts, "a pack holds at least one prompt"
        layout = lay_out(prompts, self.buckets, self.rows_of)
        assert layout.tokens <= self._budget or len(prompts) == 1, "only a single prompt may exceed the budget"
        regions, device_layout = self.regions, self.device_layout
        slot = None
        if layout.capacity > regions.capacity:  # a prompt longer than any configured size: a one-off layout
            regions = Regions.for_capacity(layout.capacity)
            device_layout = torch.zeros(regions.size, dtype=torch.int64, device=self.device)
            host = torch.zeros(regions.size, dtype=torch.int64)
            scores_host = torch.zeros(layout.rows, self.verbalizers, dtype=torch.float32)
        else:
            slot = self.slots[self._next]
            self._next = (self._next + 1) % SLOTS
            if slot.pending is not None:
                slot.pending.wait()  # its pack has finished: its buffers are free
            host, scores_host = slot.host, slot.scores
        positions = [prompt_positions(prompt, self.rope_index) for prompt in prompts]
        regions.fill(host.numpy(), layout, prompts, positions, self.pad_id)
        device_layout.copy_(host, non_blocking=True)
        cuda = self.device.type == "cuda"
        began = torch.cuda.Event(enable_timing=True) if cuda else None
        if began is not None:
            began.record()
        scores = self._forward(layout, prompts, regions, device_layout)
        out = scores_host[: layout.rows]
        out.copy_(scores[: layout.rows], non_blocking=True)
        done = torch.cuda.Event(enable_timing=True) if cuda else None
        if done is not None:
            done.record()
        before, self._last_done = self._last_done, done
        graph = layout.bucket is not None and self.graphed is not None

        def scores_ready() -> PackRun:
            """Waits for this pack's scores on the host (the GPU finished it), with its timings."""
            gpu = idle = None
            if began is not None and done is not None:
                done.synchronize()
                gpu = began.elapsed_time(done) / 1000
                # The GPU's wait between the previous pack's end and this one's start: time lost to host work.
                idle = max(0.0, before.elapsed_time(began) / 1000) if before is not None else None
            rows = out.clone()
            per_prompt = list(rows.split(list(layout.questions)))
            return PackRun(per_prompt, layout.tokens, layout.capacity, layout.bucket, graph,
                           time.perf_counter() - start, gpu, idle)

        pending = Pending(scores_ready)
        if slot is not None:
            slot.pending = pending
        return pending

    def _forward(self, layout: Layout, prompts: Sequence[Prompt], regions: Regions, flat: torch.Tensor
                 ) -> torch.Tensor:
        tokens, cap, count = layout.tokens, layout.capacity, len(layout.lengths)
        # Fresh views for every pack: fla caches host-side preparation by tensor identity.
        cu_long = flat[regions.cu: regions.cu + count + 1]
        bounds = Boundaries(
            cu=cu_long.to(torch.int32), cu_long=cu_long, cu_host=torch.tensor(layout.cu_seqlens),
            chunk_index=flat[regions.chunk_index: regions.chunk_index + 2 * layout.gdn_chunks].view(-1, 2),
            max_length=layout.max_length, cu_rows=flat[regions.cu_rows: regions.cu_rows + count + 1].to(torch.int32),
            max_rows=layout.max_questions)
        ids = flat[regions.ids: regions.ids + tokens]
        positions = flat[regions.positions: regions.positions + 3 * regions.capacity]
        positions = positions.view(3, regions.capacity)[:, :cap]
        seqpos = flat[regions.seqpos: regions.seqpos + cap]
        rows = flat[regions.rows: regions.rows + layout.rows_capacity]
        hidden = self.fwd.embed(ids, *self._images(prompts, layout))
        if layout.bucket is not None and self.graphed is not None:
            self.graphed.prologue(layout.bucket, hidden, positions, layout.rows)
            return self.graphed.replay(layout.bucket, tokens, layout.rows, bounds)
        cos, sin = self.fwd.rope_tables(positions, hidden)
        return self.fwd.run(hidden, cos, sin, seqpos, rows, bounds)

    def _images(self, prompts: Sequence[Prompt], layout: Layout) -> tuple[torch.Tensor | None, ...]:
        """Rows of the pack's image tokens, and the pixels and grids of its images, in pack order."""
        with_images = [(prompt, start) for prompt, start in zip(prompts, layout.cu_seqlens) if prompt.has_images]
        if not with_images:
            return None, None, None
        token = self.fwd.image_token_id
        rows = np.concatenate([np.flatnonzero(prompt.input_ids.numpy() == token) + start
                               for prompt, start in with_images])
        pixels = torch.cat([prompt.pixel_values for prompt, _ in with_images])
        grid = torch.cat([prompt.image_grid_thw for prompt, _ in with_images])
        return torch.from_numpy(rows).to(self.device), pixels, grid
