"""The fast engine: packs of prompts through one padding-free forward, optionally compiled and CUDA-graphed.

``launch`` lays the pack out on the host (worker/fast/layout.py), moves it with one copy from a pinned buffer
into a persistent device buffer, runs the forward (eager, or the graphs of the smallest bucket that holds the
pack) and enqueues the copy of the head scores into pinned memory; it returns without waiting for the GPU.
``Pending.wait`` waits for that copy. Two staging slots alternate, so the caller can form and launch the next
pack while one runs; a slot is reused only after its pack has finished.

Nothing in a launch waits for the GPU (FlashQLA's per-pack context comes from the host boundaries, see
worker/fast/mixers.py) except a slot's reuse, which waits for the pack launched two before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..config import Settings
from ..fast_options import COMPILE_MODES
from ..model.checkpoint import DecisionModel
from ..model.engine import Prompt, PackRun, Pending
from . import deterministic
from .errors import ALTERNATIVE, FastPathUnavailable
from .forward import PackedForward
from .graphs import Capture, GraphedForward
from .layers import LINEAR
from .layout import Boundaries, Layout, Regions, lay_out, prompt_positions
from .mixers import CudaMixers, Mixers
from .qla import FlashQLA
from .warmup import WarmUp, use_compile_cache

log = logging.getLogger(__name__)
SLOTS = 2

@dataclass
class _Slot:
    """Host side of one in-flight pack: its pinned layout buffer and pinned score rows."""

    host: torch.Tensor  # (regions.size,) int64
    scores: torch.Tensor  # (rows capacity, verbalizers) fp32
    pending: Pending | None = None


class FastEngine(WarmUp):
    """The engine: its buffers and staging slots, and ``launch`` (its start-up, ``warmup``: warmup.py)."""

    name = "fast"

    def __init__(self, model: DecisionModel, settings: Settings, mixers: Mixers | None = None,
                 capture: tuple[Capture, Callable[[Callable[[], None]], None]] | None = None) -> None:
        """``mixers``: the eager token mixers; CUDA's (fla + varlen attention) unless a test passes a
        stand-in. ``capture``: how pieces are captured and warmed; CUDA graphs unless a test passes a
        plain-call stand-in (which runs the bucketed path's static buffers on any device)."""
        if settings.compile not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {settings.compile!r}")
        if settings.compile_cache:
            use_compile_cache(settings.compile_cache)  # before anything compiles or imports TileLang
        # Deterministic mode: the same kernels, in the same order of sums, for a row whatever its pack
        # (worker/fast/deterministic.py).
        self.deterministic = deterministic.decide(model, settings)
        if self.deterministic:
            deterministic.enable()
        if mixers is None:
            if model.device.type != "cuda":
                raise FastPathUnavailable(f"the fast engine runs on CUDA; this model is on {model.device}: "
                                          f"load it on a GPU (--device cuda), or {ALTERNATIVE}")
            mixers = CudaMixers(invariant=self.deterministic)
        self.device = model.device
        self.graphs_on = settings.cuda_graphs and (self.device.type == "cuda" or capture is not None)
        self._capture_with = capture
        if settings.fp8:
            from .fp8 import require_fp8

            require_fp8(self.device)
        # Every pack's budget is --pack-tokens; with graphs it is the largest bucket too (worker/config.py).
        self.buckets = settings.bucket_sizes if self.graphs_on else ()
        self._budget = settings.pack_tokens
        if self.graphs_on and self.buckets != settings.listed_buckets:
            log.info("CUDA graph buckets %s: --buckets %s up to --pack-tokens %d, which is the largest",
                     ",".join(map(str, self.buckets)), settings.buckets, settings.pack_tokens)
        self.model, self.settings = model, settings.replace(deterministic=self.deterministic)
        self.pad_id = model.pad_id
        fused = settings.fused_kernels and self.device.type == "cuda" and model.dtype in (torch.bfloat16,
                                                                                         torch.float16)
        self.fwd = PackedForward(model, mixers, prune_last=settings.prune_last,
                                 fp8=settings.fp8, fp8_layers=settings.fp8_layers,
                                 fp8_matrices=settings.fp8_matrices, compile=settings.compile,
                                 compile_pieces=not self.graphs_on, fused=fused,
                                 image_by_image=self.deterministic, epilogues=settings.epilogues,
                                 deterministic=self.deterministic)
        linear = self.linear_dims = next((stage.dims for stage in self.fwd.stages
                                          if stage.kind == LINEAR), None)
        # Where the delta rule runs on FlashQLA (else on fla's kernels, or the stand-in mixers).
        self.on_flash_qla = (linear is not None and getattr(mixers, "flash_qla", None) is not None
                             and FlashQLA.takes(model.dtype, linear.head_k, linear.head_v))
        if (self.deterministic and isinstance(mixers, CudaMixers) and linear is not None
                and not self.on_flash_qla):
            # fla's kernels pick their configuration by timing, per process.
            raise ValueError("deterministic mode runs the delta rule on FlashQLA, which takes bf16 or fp16 "
                             f"and 128-wide heads; this model is {model.dtype} with {linear.head_k}-wide "
                             "heads")
        if self.deterministic and self.device.type == "cuda" and not (self.graphs_on
                                                                      and settings.compile == "layer"):
            # Eager packs run each length's own kernels (and their own reduction orders): only the graphed,
            # compiled pieces are built to be the same for every bucket.
            raise ValueError("deterministic mode runs packs from CUDA graphs of compiled layers "
                             f"(--cuda-graphs, --compile layer); here cuda_graphs={settings.cuda_graphs}, "
                             f"compile={settings.compile}")
        self.rope_index = getattr(model.backbone, "get_rope_index", None) if model.multimodal else None
        self.verbalizers = int(model.model.proj.out_features)
        # Host and device layout buffers: large enough for a full pack or the longest prompt the encoder
        # makes.
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

    @property
    def pack_sizes(self) -> tuple[int, ...]:
        return self.buckets

    # ---- packs ----

    @torch.inference_mode()
    def launch(self, prompts: Sequence[Prompt]) -> Pending:
        start = time.perf_counter()
        assert prompts, "a pack holds at least one prompt"
        layout = lay_out(prompts, self.buckets)
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

        # On a GPU the pack's end event says whether it is done; elsewhere the launch computed it.
        pending = Pending(scores_ready, finished=done.query if done is not None else lambda: True)
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
