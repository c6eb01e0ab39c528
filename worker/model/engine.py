"""The engine contract: what the queue stages hand an engine (``Prompt``), and what every engine offers them
(``Engine``: run one pack of prompts, get head scores back as a ``PackRun``).

``launch`` starts a pack and returns at once where the device allows (the GPU works while the daemon forms the
next pack); ``Pending.wait`` returns the scores. The reference engine computes synchronously.

Tensors and questions are named here for their types only: the contract loads without torch or transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Callable, Protocol

if TYPE_CHECKING:
    import torch
    from transformers.decision import Question


# A bucket's graphs compute one marker row (a question's head) per this many of its tokens
# (worker/fast/layout.py): a pack charged this many tokens per question never has more questions than its
# bucket's rows, so never leaves the graphs for the eager path for that (deterministic mode relies on it).
TOKENS_PER_ROW = 8


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: what an engine needs to score its questions."""

    input_ids: torch.Tensor  # (length,) int64
    rows: torch.Tensor  # (questions,) positions the head reads: the token before each mark
    questions: tuple[Question, ...]  # in readout order; options in logit order
    pixel_values: torch.Tensor | None = None  # (patches, dim) for the vision tower
    image_grid_thw: torch.Tensor | None = None  # (images, 3)
    mm_token_type_ids: torch.Tensor | None = None  # (length,) 1 at image tokens; for M-RoPE positions
    # holds some of the questions of a request whose one prompt was too long (or of a part)
    split: bool = False

    # Cached: the packer reads them for every queued prompt each time it forms a pack.
    @cached_property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    @cached_property
    def room(self) -> int:
        """The tokens of pack room it takes: its length, or ``TOKENS_PER_ROW`` per question where it has more
        questions than that."""
        return max(self.length, TOKENS_PER_ROW * len(self.questions))

    @property
    def has_images(self) -> bool:
        return self.image_grid_thw is not None


@dataclass(frozen=True)
class PackRun:
    """What one forward pass did: per-prompt head scores and the facts the metrics report."""

    scores: list[torch.Tensor]  # per prompt: (questions, verbalizers) float32 on the CPU
    tokens: int  # real prompt tokens in the pack
    capacity: int  # tokens the pass computed (bucket size, or batch x longest for padded batches)
    bucket: int | None  # the static bucket it ran in, None when eager
    graph: bool  # replayed through a captured CUDA graph
    seconds: float  # launch to scores on the host
    gpu_seconds: float | None = None  # the pack's own time on the GPU (engines that measure it)
    idle_seconds: float | None = None  # the GPU's wait between the previous pack's end and this one's start


class Pending:
    """A launched pack; ``wait`` blocks until its scores are on the host; ``done`` says, without blocking, whether
    the device has finished it (False when the engine cannot tell)."""

    def __init__(self, finish: Callable[[], PackRun], finished: Callable[[], bool] | None = None) -> None:
        self._finish = finish
        self._finished = finished
        self._run: PackRun | None = None

    def done(self) -> bool:
        return self._run is not None or (self._finished is not None and self._finished())

    def wait(self) -> PackRun:
        if self._run is None:
            self._run = self._finish()
        return self._run


class Engine(Protocol):
    """The engine contract: packs of prompts in, head scores out (reference.py, worker/fast)."""

    name: str
    deterministic: bool  # a prompt's logits depend on it alone (worker/fast/deterministic.py)

    @property
    def max_pack_tokens(self) -> int:
        """Token budget the packer fills; a single prompt longer than this still runs (eagerly, alone)."""

    @property
    def pack_sizes(self) -> tuple[int, ...]:
        """The static sizes a pack is padded to (CUDA graph buckets); empty: a pack costs its real tokens."""

    def warmup(self) -> None:
        """Compile and capture everything up front, before the worker reports ready."""

    def launch(self, prompts: list[Prompt]) -> Pending: ...
