"""Layout of one pack: prompts concatenated into one padding-free sequence, and the host buffer that describes
it.

Pure CPU code (unit-tested without a GPU). A pack is the prompts in order, ``cu_seqlens`` at their boundaries,
a position within its prompt for every token (the convolution never reads across a boundary), M-RoPE positions
that restart at 0 for every prompt, and the marker rows the head reads. With static buckets the pack is padded
to the bucket's size: the tail rows are inert (position 0, never read by a real row, never passed to the
attention or delta-rule kernels, which see the real tokens only).

Everything the device needs goes through one flat int64 host buffer (``Regions``) so that one pinned copy
moves it.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from ..model.engine import TOKENS_PER_ROW, Prompt

GDN_CHUNK = 64  # the gated delta rule kernels' chunk size (fla's default): the only 'chunk' of this project
_ALIGN = 64  # region offsets in int64 elements: keeps every device view 16-byte aligned


def choose_bucket(tokens: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``tokens``; None when none does (the pack runs eagerly)."""
    ordered = sorted(buckets)
    index = bisect.bisect_left(ordered, tokens)
    return ordered[index] if index < len(ordered) else None


def row_capacity(bucket: int) -> int:
    """Marker rows a bucket's graphs compute: a pack with more goes to a larger bucket, or runs eagerly
    where none holds them. Every row is a distinct token."""
    return min(bucket, max(64, bucket // TOKENS_PER_ROW))


@dataclass(frozen=True)
class Layout:
    """Where each prompt of a pack lies and what the forward computes for it."""

    lengths: tuple[int, ...]
    questions: tuple[int, ...]
    capacity: int  # token rows the dense layers compute: the bucket, or the real tokens when eager
    rows_capacity: int  # marker rows the last layer and head compute
    bucket: int | None

    def __post_init__(self) -> None:
        assert self.lengths and all(n > 0 for n in self.lengths), "a pack holds non-empty prompts"
        assert self.capacity >= self.tokens and self.rows_capacity >= self.rows

    @property
    def tokens(self) -> int:
        return self.cu_seqlens[-1]

    @property
    def rows(self) -> int:
        return self.cu_rows[-1]

    # Cached: the launch reads them several times per pack.
    @cached_property
    def cu_seqlens(self) -> list[int]:
        return [0, *itertools.accumulate(self.lengths)]

    @cached_property
    def cu_rows(self) -> list[int]:
        return [0, *itertools.accumulate(self.questions)]

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    @property
    def max_questions(self) -> int:
        return max(self.questions)

    @property
    def gdn_chunks(self) -> int:
        return sum(-(-n // GDN_CHUNK) for n in self.lengths)


def lay_out(prompts: Sequence[Prompt], buckets: Sequence[int]) -> Layout:
    """The layout of ``prompts``: in the smallest bucket that holds them and their rows (``row_capacity``), else
    eager. The packer charges each question ``TOKENS_PER_ROW`` tokens at least (``Prompt.room``), so a pack of
    at most the largest bucket always finds one, and never leaves the graphs (deterministic mode relies on it)."""
    lengths = tuple(prompt.length for prompt in prompts)
    questions = tuple(len(prompt.questions) for prompt in prompts)
    tokens, rows = sum(lengths), sum(questions)
    bucket = choose_bucket(tokens, buckets)
    while bucket is not None and rows > row_capacity(bucket):
        bucket = choose_bucket(bucket + 1, buckets)
    if bucket is None:
        return Layout(lengths, questions, tokens, rows, None)
    return Layout(lengths, questions, bucket, row_capacity(bucket), bucket)


def gdn_chunk_indices(lengths: Sequence[int]) -> np.ndarray:
    """(chunks, 2) [prompt, chunk within it] for every 64-token chunk of the delta rule: what fla computes
    from cu_seqlens on the host. Handing it over avoids fla's device-to-host copy."""
    counts = np.array([-(-n // GDN_CHUNK) for n in lengths], dtype=np.int64)
    seq = np.repeat(np.arange(len(lengths), dtype=np.int64), counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)
    return np.stack([seq, within], axis=1)


RopeIndex = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def prompt_positions(prompt: Prompt, rope_index: RopeIndex | None) -> np.ndarray:
    """(3, length) M-RoPE positions of one prompt, from 0: the text positions, or the backbone's
    ``get_rope_index`` where the prompt holds images."""
    if not prompt.has_images:
        return np.broadcast_to(np.arange(prompt.length, dtype=np.int64), (3, prompt.length))
    assert rope_index is not None and prompt.mm_token_type_ids is not None, "image prompts need M-RoPE positions"
    positions, _ = rope_index(prompt.input_ids[None], prompt.mm_token_type_ids[None],
                              image_grid_thw=prompt.image_grid_thw)
    return positions[:, 0].numpy().astype(np.int64, copy=False)


@dataclass(frozen=True)
class Regions:
    """Offsets of the flat int64 buffer that carries a pack to the device (host and device share them)."""

    capacity: int  # most token rows
    ids: int
    positions: int  # 3 rows of ``capacity``
    seqpos: int
    rows: int  # ``capacity`` entries: marker rows never outnumber tokens
    cu: int  # capacity + 1
    cu_rows: int  # capacity + 1
    chunk_index: int  # 2 * (capacity // GDN_CHUNK + capacity)
    size: int

    @classmethod
    def for_capacity(cls, capacity: int) -> Regions:
        sizes = {"ids": capacity, "positions": 3 * capacity, "seqpos": capacity, "rows": capacity,
                 "cu": capacity + 1, "cu_rows": capacity + 1,
                 "chunk_index": 2 * (capacity // GDN_CHUNK + capacity)}
        offsets, cursor = {}, 0
        for name, size in sizes.items():
            offsets[name] = cursor
            cursor += -(-size // _ALIGN) * _ALIGN
        return cls(capacity=capacity, size=cursor, **offsets)

    def fill(self, buffer: np.ndarray, layout: Layout, prompts: Sequence[Prompt], positions: Sequence[np.ndarray],
             pad_id: int) -> None:
        """Write ``layout`` into ``buffer`` (a host view of the flat buffer). Tails up to the capacities are
        reset so that a bucket's inert rows read position 0 and marker row 0."""
        assert buffer.shape == (self.size,) and layout.capacity <= self.capacity
        cap, rcap, tokens, rows = layout.capacity, layout.rows_capacity, layout.tokens, layout.rows
        starts = layout.cu_seqlens[:-1]
        ids = buffer[self.ids: self.ids + cap]
        ids[:tokens] = np.concatenate([prompt.input_ids.numpy() for prompt in prompts])
        ids[tokens:] = pad_id
        pos = buffer[self.positions: self.positions + 3 * self.capacity].reshape(3, self.capacity)
        pos[:, :tokens] = np.concatenate(positions, axis=1)
        pos[:, tokens:cap] = 0
        seqpos = buffer[self.seqpos: self.seqpos + cap]
        seqpos[:tokens] = np.concatenate([np.arange(n, dtype=np.int64) for n in layout.lengths])
        seqpos[tokens:] = 0
        marker = buffer[self.rows: self.rows + rcap]
        marker[:rows] = np.concatenate([prompt.rows.numpy() + start for prompt, start in zip(prompts, starts)])
        marker[rows:] = 0
        count = len(layout.lengths)
        buffer[self.cu: self.cu + count + 1] = layout.cu_seqlens
        buffer[self.cu_rows: self.cu_rows + count + 1] = layout.cu_rows
        index = gdn_chunk_indices(layout.lengths)
        buffer[self.chunk_index: self.chunk_index + index.size] = index.reshape(-1)


class Boundaries(NamedTuple):
    """Where each prompt of a pack starts and ends, as the mixers' kernels read it."""

    cu: torch.Tensor  # (prompts + 1,) int32 on the device
    cu_long: torch.Tensor  # the same, int64 (fla)
    # the same on the host (FlashQLA's context is prepared from it; fla's cu_seqlens_cpu)
    cu_host: torch.Tensor
    chunk_index: torch.Tensor  # (delta-rule chunks, 2) int64 on the device
    max_length: int
    cu_rows: torch.Tensor  # (prompts + 1,) int32: marker rows per prompt (pruned last layer)
    max_rows: int


def boundaries_of(lengths: Sequence[int], device: torch.device | str) -> Boundaries:
    """The boundaries of one pack of prompts of these lengths with one marker row each, copied to ``device``:
    for the mixers alone in tests and benchmarks (the engine views its per-pack layout buffer instead)."""
    cu = [0, *itertools.accumulate(lengths)]
    cu_long = torch.tensor(cu).to(device, non_blocking=True)
    cu_rows = torch.arange(len(cu), dtype=torch.int32).to(device, non_blocking=True)
    index = torch.from_numpy(gdn_chunk_indices(lengths)).to(device, non_blocking=True)
    return Boundaries(cu=cu_long.int(), cu_long=cu_long, cu_host=torch.tensor(cu), chunk_index=index,
                      max_length=max(lengths), cu_rows=cu_rows, max_rows=1)
