"""The reference engine: padded batches through the checkpoint's own backbone, exactly as it computes a prompt.

Chunks are right-padded into one batch with an attention mask: full-attention layers then attend only to real
tokens (noncausal where the checkpoint says so), and the linear-attention layers, which are causal, never see the
padding that follows a prompt. This is the path the fast engine is checked against, and the one CPUs run.
"""

from __future__ import annotations

import time

import torch

from ..config import Settings
from .checkpoint import DecisionModel
from .engine import Chunk, PackRun, Pending
from .readout import head


class ReferenceEngine:
    name = "reference"

    def __init__(self, model: DecisionModel) -> None:
        self.model = model

    @torch.inference_mode()
    def forward(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        """Head scores (questions, verbalizers) of each chunk, float32 on the CPU."""
        model, device = self.model, self.model.device
        width = max(chunk.length for chunk in chunks)
        input_ids = torch.full((len(chunks), width), model.pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunks), width), dtype=torch.long)
        for index, chunk in enumerate(chunks):
            input_ids[index, : chunk.length] = chunk.input_ids
            mask[index, : chunk.length] = 1
        extra = {}
        if any(chunk.has_images for chunk in chunks):
            types = torch.zeros((len(chunks), width), dtype=torch.long)
            for index, chunk in enumerate(chunks):
                if chunk.mm_token_type_ids is not None:
                    types[index, : chunk.length] = chunk.mm_token_type_ids
            with_images = [chunk for chunk in chunks if chunk.has_images]
            extra = {
                "pixel_values": torch.cat([c.pixel_values for c in with_images]).to(device, model.dtype),
                "image_grid_thw": torch.cat([c.image_grid_thw for c in with_images]).to(device),
                "mm_token_type_ids": types.to(device),
            }
        hidden = model.backbone(input_ids=input_ids.to(device), attention_mask=mask.to(device), use_cache=False,
                                **extra).last_hidden_state
        rows = torch.cat([hidden[i, chunk.rows.to(device)] for i, chunk in enumerate(chunks)])
        scores = head(model, rows).cpu()
        return list(scores.split([len(chunk.questions) for chunk in chunks]))


class ReferenceAdapter:
    """The padded reference engine behind the Engine contract (CPU, or GPU for checking)."""

    name = "reference"

    def __init__(self, model: DecisionModel, settings: Settings) -> None:
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
