"""The reference engine: padded batches through the checkpoint's own backbone, exactly as it computes a
prompt.

Prompts are right-padded into one batch with an attention mask: full-attention layers then attend only to real
tokens (noncausal where the checkpoint says so), and the linear-attention layers, which are causal, never see
the padding that follows a prompt. This is the path the fast engine is checked against, and the one CPUs run.
"""

from __future__ import annotations

import logging
import time

import torch

from ..config import Settings
from ..fast_options import DEFAULT_EPILOGUES, chosen_epilogues
from .checkpoint import DecisionModel
from .engine import Prompt, PackRun, Pending
from .readout import head

log = logging.getLogger("worker")


class ReferenceEngine:
    """The checkpoint's own backbone over padded batches: the scores every engine is checked against."""

    name = "reference"

    def __init__(self, model: DecisionModel) -> None:
        self.model = model

    @torch.inference_mode()
    def forward(self, prompts: list[Prompt]) -> list[torch.Tensor]:
        """Head scores (questions, verbalizers) of each prompt, float32 on the CPU."""
        model, device = self.model, self.model.device
        width = max(prompt.length for prompt in prompts)
        input_ids = torch.full((len(prompts), width), model.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for index, prompt in enumerate(prompts):
            input_ids[index, : prompt.length] = prompt.input_ids
            mask[index, : prompt.length] = 1
        extra = {}
        if any(prompt.has_images for prompt in prompts):
            types = torch.zeros((len(prompts), width), dtype=torch.long)
            for index, prompt in enumerate(prompts):
                if prompt.mm_token_type_ids is not None:
                    types[index, : prompt.length] = prompt.mm_token_type_ids
            with_images = [prompt for prompt in prompts if prompt.has_images]
            extra = {
                "pixel_values": torch.cat([c.pixel_values for c in with_images]).to(device, model.dtype),
                "image_grid_thw": torch.cat([c.image_grid_thw for c in with_images]).to(device),
                "mm_token_type_ids": types.to(device),
            }
        hidden = model.backbone(input_ids=input_ids.to(device), attention_mask=mask.to(device),
                                use_cache=False, **extra).last_hidden_state
        rows = torch.cat([hidden[i, prompt.rows.to(device)] for i, prompt in enumerate(prompts)])
        scores = head(model, rows).cpu()
        return list(scores.split([len(prompt.questions) for prompt in prompts]))


class ReferenceAdapter:
    """The padded reference engine behind the Engine contract (CPU, or GPU for checking)."""

    name = "reference"

    def __init__(self, model: DecisionModel, settings: Settings) -> None:
        self.engine = ReferenceEngine(model)
        self._budget = settings.pack_tokens
        # Padding a prompt to the batch's longest changes its GEMMs' and attention's shapes, and with them the
        # order of its sums: deterministic mode computes each prompt alone, in shapes that are its own.
        self.deterministic = bool(settings.deterministic)  # unset: off (worker/daemon.py says so at start)
        # The default names the fast engine's kernels; only a choice made for this worker is worth saying
        # dropped.
        if chosen_epilogues(settings.epilogues) not in (frozenset(), chosen_epilogues(DEFAULT_EPILOGUES)):
            log.info("--epilogues %s not applied: the reference engine runs the checkpoint's own modules "
                     "(the epilogues are kernels of the fast engine)", settings.epilogues)

    @property
    def max_pack_tokens(self) -> int:
        return self._budget

    @property
    def pack_sizes(self) -> tuple[int, ...]:
        return ()

    def warmup(self) -> None:
        pass

    def launch(self, prompts: list[Prompt]) -> Pending:
        start = time.perf_counter()
        if self.deterministic:
            scores = [self.engine.forward([prompt])[0] for prompt in prompts]
            capacity = sum(prompt.length for prompt in prompts)
        else:
            scores = self.engine.forward(prompts)
            capacity = len(prompts) * max(prompt.length for prompt in prompts)
        run = PackRun(scores, sum(c.length for c in prompts), capacity, None, False,
                      time.perf_counter() - start)
        return Pending(lambda: run, finished=lambda: True)  # computed in the launch
