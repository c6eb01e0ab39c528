"""The fast engine's start-up, a part of FastEngine (engine.py): every bucket's graphs captured, the delta
rule's kernel variants compiled beside them (prebuild.py), a first pack through each path so that nothing
compiles on the first request, and deterministic mode's own check. Each stage is logged as it goes (minutes on
a cold machine).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

import torch
from transformers.decision import Question

from ..config import Settings
from ..model.checkpoint import DecisionModel
from ..model.engine import Prompt, Pending
from . import deterministic, prebuild
from .forward import PackedForward
from .graphs import Capture, GraphedForward, Workspace, cuda_capture, cuda_warmer
from .layers import LinearDims
from .layout import Regions, row_capacity

log = logging.getLogger(__name__)
WARMUP = Question(name="warmup", type="noul", instructions=None, options=["false", "true"], labels=["A", "B"],
                  descriptions=[None, None])  # the warm-up's prompts ask this
CACHES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton",
          "TILELANG_CACHE_DIR": "tilelang"}


def use_compile_cache(path: str) -> None:
    """Inductor's, Triton's and TileLang's caches under one directory (``compile_cache``): a worker that finds
    them there from an earlier start skips compiling. Set before the first compilation (they read these at
    use)."""
    for variable, name in CACHES.items():
        os.environ[variable] = os.path.join(os.path.abspath(path), name)
        os.makedirs(os.environ[variable], exist_ok=True)


class WarmUp:
    """FastEngine's start-up. What it reads of the engine (set by FastEngine.__init__):"""

    model: DecisionModel
    settings: Settings
    fwd: PackedForward
    buckets: tuple[int, ...]
    deterministic: bool
    on_flash_qla: bool
    linear_dims: LinearDims | None
    graphs_on: bool
    graphed: GraphedForward | None
    regions: Regions
    device_layout: torch.Tensor
    verbalizers: int
    pad_id: int
    device: torch.device
    capture_seconds: float
    compile_seconds: float
    _budget: int
    _capture_with: tuple[Capture, Callable[[Callable[[], None]], None]] | None

    def launch(self, prompts: Sequence[Prompt]) -> Pending:
        raise NotImplementedError  # FastEngine's

    def warmup(self) -> None:
        """Capture every bucket's graphs (largest first, one pool), then run a pack through each path so that
        compilation and the mixers' JIT happen now rather than on the first request. Each stage is logged as
        it goes (minutes on a cold machine)."""
        start = time.perf_counter()
        if self.deterministic and self.device.type == "cuda":
            linears = [linear for stage in self.fwd.stages
                       for linear in deterministic.linears_of(stage.weights)]
            # the pruned last layer's GEMMs run at the buckets' marker rows
            sizes = sorted({*self.buckets, *map(row_capacity, self.buckets)})
            checked = deterministic.check_gemms([*linears, self.fwd.head.proj], sizes, self.model.dtype)
            log.info("deterministic mode: %d GEMMs give every row the same bits at %s rows (%.1fs)", checked,
                     sizes, time.perf_counter() - start)
        # The delta rule's kernels come in variants (FlashQLA: split across the card or not, and the tile
        # width its grid size picks), each JIT-compiled on first use (tens of seconds each): one pack for each
        # variant that any pack of at most the budget, or one prompt up to the longest, can reach
        # (worker/fast/qla.py). Child processes compile them beside the capture (worker/fast/prebuild.py); the
        # packs below then load them.
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
        if self.deterministic:
            self._check_deterministic()
        self.compile_seconds = time.perf_counter() - start - self.capture_seconds
        log.info("fast engine ready: buckets %s, compile %s, graphs %s, prune %s, fp8 %s (%d matrices, "
                 "layers %s, %s), fused kernels %s (epilogues %s); capture %.1fs, first packs %.1fs (%d "
                 "delta-rule variants)",
                 self.buckets or "-", self.settings.compile, self.graphs_on, self.fwd.pruned, self.settings.fp8,
                 self.fwd.fp8_matrices, self.settings.fp8_layers, self.settings.fp8_matrices, self.fwd.fused,
                 ",".join(sorted(self.fwd.epilogues)) or "none", self.capture_seconds, self.compile_seconds,
                 len(variants))

    def _check_deterministic(self) -> None:
        """Deterministic mode keeps its promise on this card and software before the worker reports ready:
        probe prompts of random tokens (of one question, then two) alone, then first and last in packs that fill
        every bucket, beside one filler or many short ones of two questions each (the delta rule's widest tile,
        where alone it takes its narrowest), must score the same bits."""
        began, checked = time.perf_counter(), 0
        generator = torch.Generator().manual_seed(0)
        tokenizer = getattr(self.model, "tokenizer", None)
        vocab = int(self.fwd.embed_tokens.weight.shape[0])
        vocab = min(vocab, len(tokenizer)) if tokenizer is not None else vocab  # ids a request can hold
        image = self.fwd.image_token_id

        def probe(length: int, questions: int = 2) -> Prompt:
            ids = torch.randint(0, vocab, (length,), generator=generator)
            if image is not None:
                ids[ids == image] = self.pad_id
            rows = [length // 2, length - 1][2 - questions:]
            return Prompt(input_ids=ids, rows=torch.tensor(rows), questions=(WARMUP,) * questions)

        buckets = self.buckets or (self._budget,)
        smallest = min(buckets)
        lengths = sorted({max(2, min(37, smallest // 2)), max(2, smallest // 3)})
        for number, length in enumerate(lengths):
            # one question first: alone, the pruned layer's attention then has one query row per prompt
            target = probe(length, 1 if number == 0 else 2)
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
                        # bits, NaN included
                        if not torch.equal(got.view(torch.int32), alone.view(torch.int32)):
                            raise deterministic.NotDeterministic(
                                f"deterministic mode's check at warm-up: a {length}-token probe prompt "
                                f"scored other bits {'first' if at == 0 else 'last'} in a pack of "
                                f"{len(pack)} prompts (bucket {bucket}) than alone, up to "
                                f"{(got - alone).abs().max().item():g} apart, on this card and software: run "
                                "with --no-deterministic (the mode is on by default where its kernels run)")
        if not checked:
            raise deterministic.NotDeterministic("deterministic mode's check at warm-up found no pack to "
                                                 f"check: the buckets {buckets} are too small (at least 4 "
                                                 "tokens)")
        log.info("deterministic mode: %d probe packs scored their probe prompts bitwise as alone (%.1fs)", checked,
                 time.perf_counter() - began)

    def _prebuild(self, variants: dict, dims: LinearDims | None) -> prebuild.Prebuild | None:
        """Children compiling FlashQLA's variants, where the delta rule runs on FlashQLA (CUDA, 128-wide
        heads)."""
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
            ws = Workspace(self.fwd, max(self.buckets), row_capacity(max(self.buckets)), self.verbalizers,
                           self.device, self.model.dtype)
            self.graphed = GraphedForward(self.fwd, ws, compile_layers=self.settings.compile == "layer",
                                          invariant=self.deterministic)
            capture, warm = self._capture_with or (cuda_capture(torch.cuda.graph_pool_handle()), cuda_warmer())
            self.graphed.capture(self.buckets, self._static_inputs, capture, warm, log=log)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the warm-up stream's cached blocks; the graphs keep their pool

    def _static_inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        regions = self.regions
        return (self.device_layout[regions.seqpos: regions.seqpos + bucket],
                self.device_layout[regions.rows: regions.rows + row_capacity(bucket)])

    def _dummy_pack(self, lengths: Sequence[int]) -> list[Prompt]:
        """Prompts of padding of these lengths, one marker each."""
        return [Prompt(input_ids=torch.full((n,), self.pad_id, dtype=torch.long), rows=torch.tensor([n - 1]),
                      questions=(WARMUP,)) for n in lengths if n > 0]
