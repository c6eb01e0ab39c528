"""The interface every engine offers the daemon: run one pack of chunks, get head scores back.

``launch`` starts a pack and returns at once where the device allows (the GPU works while the daemon forms the
next pack); ``Pending.wait`` returns the scores. The reference engine computes synchronously.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .checkpoint import DecisionModel
from .config import Settings
from .encoder import Chunk


@dataclass(frozen=True)
class PackRun:
    """What one forward pass did: per-chunk head scores and the facts the metrics report."""

    scores: list[torch.Tensor]  # per chunk: (questions, verbalizers) float32 on the CPU
    tokens: int  # real prompt tokens in the pack
    capacity: int  # tokens the pass computed (bucket size, or batch x longest for padded batches)
    bucket: int | None  # the static bucket it ran in, None when eager
    graph: bool  # replayed through a captured CUDA graph
    seconds: float  # launch to scores on the host


class Pending:
    """A launched pack; ``wait`` blocks until its scores are on the host."""

    def __init__(self, finish: Callable[[], PackRun]) -> None:
        self._finish = finish
        self._run: PackRun | None = None

    def wait(self) -> PackRun:
        if self._run is None:
            self._run = self._finish()
        return self._run


class Engine(Protocol):
    name: str

    @property
    def max_pack_tokens(self) -> int:
        """Token budget the packer fills; a single chunk longer than this still runs (eagerly, alone)."""

    def warmup(self) -> None:
        """Compile and capture everything up front, before the worker reports ready."""

    def launch(self, chunks: list[Chunk]) -> Pending: ...


class ReferenceAdapter:
    """The padded reference engine behind the Engine interface (CPU, or GPU for checking)."""

    name = "reference"

    def __init__(self, model: DecisionModel, settings: Settings) -> None:
        from .reference import ReferenceEngine

        self.engine = ReferenceEngine(model)
        self._budget = settings.pack_tokens

    @property
    def max_pack_tokens(self) -> int:
        return self._budget

    def warmup(self) -> None:
        pass

    def launch(self, chunks: list[Chunk]) -> Pending:
        start = time.perf_counter()
        scores = self.engine.forward(chunks)
        capacity = len(chunks) * max(chunk.length for chunk in chunks)
        run = PackRun(scores, sum(c.length for c in chunks), capacity, None, False, time.perf_counter() - start)
        return Pending(lambda: run)


def create(model: DecisionModel, settings: Settings) -> Engine:
    """``auto``: the fast engine on CUDA, the reference engine elsewhere."""
    kind = settings.engine
    if kind == "auto":
        kind = "fast" if model.device.type == "cuda" else "reference"
    if kind == "reference":
        return ReferenceAdapter(model, settings)
    if kind == "fast":
        from .fast import FastEngine  # needs CUDA and flash-linear-attention; says so clearly if missing

        return FastEngine(model, settings)
    raise ValueError(f"engine must be auto, fast or reference, got {settings.engine!r}")
