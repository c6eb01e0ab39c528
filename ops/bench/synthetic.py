"""Random decision models at the real Qwen3.5 shapes, and the synthetic workloads of the benchmark.

No weights can be downloaded: the backbone is built from its config with random weights (transformers' own
initialisation, on the GPU, in bf16), noncausal, with a decision head on top. Token ids are random; marker rows sit
near the end of each prompt like a decision template's questions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
from transformers.decision import Question

from worker.model.checkpoint import DecisionModel, RenderSpec
from worker.model.engine import Prompt

# DESIGN.md section 1 (public configs). The vision tower's size is not in that table: Qwen3-VL-2B's is assumed.
SHAPES = {
    "0.8b": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                 linear_num_key_heads=16, linear_num_value_heads=16, intermediate_size=3584),
    "2b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
               linear_num_key_heads=16, linear_num_value_heads=16, intermediate_size=6144),
    "4b": dict(hidden_size=2560, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
               linear_num_key_heads=16, linear_num_value_heads=32, intermediate_size=9216),
}
VISION = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, patch_size=16, spatial_merge_size=2,
              temporal_patch_size=2, num_position_embeddings=2304)
VOCAB, IMAGE_TOKEN, VISION_START, VISION_END = 248320, 248056, 248053, 248054
VERBALIZERS = 16
OFFSETS = {"noul": 0, "score": 2, "choice": 8}
KINDS = (("noul", 2), ("choice", 4), ("score", 5))


def random_model(shape: str, multimodal: bool = False, device: str = "cuda", rendering: RenderSpec | None = None
                 ) -> DecisionModel:
    """``rendering``: the template and tokenizer requests are rendered with (the end-to-end benchmark's planner);
    without one the model has none, and its prompts come from the synthetic workloads."""
    from transformers import JevConfig, JevForDecision, Qwen3_5Config, Qwen3_5TextConfig
    from transformers.decision import DecisionConfig

    text = dict(vocab_size=VOCAB, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
                max_position_embeddings=32768, is_causal=False, tie_word_embeddings=True, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10], "mrope_interleaved": True},
                **SHAPES[shape])
    if multimodal:
        backbone = Qwen3_5Config(text_config=text, vision_config={**VISION, "out_hidden_size": text["hidden_size"]},
                                 image_token_id=IMAGE_TOKEN, vision_start_token_id=VISION_START,
                                 vision_end_token_id=VISION_END, tie_word_embeddings=True)
    else:
        backbone = Qwen3_5TextConfig(**text)
    config = JevConfig(text_config=backbone, hidden_size=text["hidden_size"], num_verbalizers=VERBALIZERS,
                       offsets=OFFSETS, softcap=30.0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = JevForDecision(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.decision_config = rendering.decision_config if rendering else DecisionConfig()
    tokenizer = rendering.processor if rendering else SimpleNamespace(pad_token_id=0)
    return DecisionModel(model=model, decision_config=model.decision_config, processor=tokenizer,
                         name=f"random-{shape}", multimodal=multimodal, max_length=8192)


def _question(kind: str, options: int) -> Question:
    labels = [chr(ord("A") + i) for i in range(options)]
    return Question(name=kind, type=kind, instructions=None, options=labels, labels=labels,
                    descriptions=[None] * options)


@dataclass(frozen=True)
class Request:
    prompts: list[Prompt]

    @property
    def tokens(self) -> int:
        return sum(c.length for c in self.prompts)


def _text_prompt(rng: np.random.Generator, length: int, questions: int) -> Prompt:
    ids = torch.from_numpy(rng.integers(1, 150000, size=length, dtype=np.int64))
    # one marker every 12 tokens at the end of the prompt, as a template prints the questions last
    rows = torch.tensor([length - 1 - 12 * (questions - 1 - i) for i in range(questions)], dtype=torch.long)
    assert int(rows.min()) >= 0
    kinds = [KINDS[i % len(KINDS)] for i in range(questions)]
    return Prompt(input_ids=ids, rows=rows, questions=tuple(_question(k, n) for k, n in kinds))


def standard(rng: np.random.Generator, count: int) -> list[Request]:
    """256-768 tokens (uniform), three questions: noul, 4-way choice, 5-level score."""
    return [Request([_text_prompt(rng, int(rng.integers(256, 769)), 3)]) for _ in range(count)]


def long_tail(rng: np.random.Generator, count: int) -> list[Request]:
    """Log-normal lengths with median 224 and p95 about 4.4k tokens (32..8192), 1-12 questions."""
    sigma = (math.log(4400) - math.log(224)) / 1.645
    lengths = np.clip(np.exp(rng.normal(math.log(224), sigma, size=count)), 32, 8192).astype(int)
    out = []
    for length in lengths:
        questions = int(rng.integers(1, 13))
        length = max(int(length), 12 * questions + 1)
        out.append(Request([_text_prompt(rng, length, questions)]))
    return out


def vision(rng: np.random.Generator, count: int, side: int = 448) -> list[Request]:
    """One side x side image (patch 16, merge 2: (side/32)^2 tokens) and 64-256 text tokens, three questions."""
    grid = torch.tensor([[1, side // 16, side // 16]])
    patches, image_tokens = (side // 16) ** 2, (side // 32) ** 2
    out = []
    for _ in range(count):
        before, after = int(rng.integers(16, 64)), int(rng.integers(48, 193))
        text = _text_prompt(rng, before + image_tokens + 2 + after, 3)
        ids = text.input_ids.clone()
        ids[before] = VISION_START
        ids[before + 1: before + 1 + image_tokens] = IMAGE_TOKEN
        ids[before + 1 + image_tokens] = VISION_END
        types = torch.zeros_like(ids)
        types[before + 1: before + 1 + image_tokens] = 1
        pixels = torch.from_numpy(rng.standard_normal((patches, 3 * 2 * 16 * 16), dtype=np.float32))
        out.append(Request([Prompt(input_ids=ids, rows=text.rows, questions=text.questions, pixel_values=pixels,
                                  image_grid_thw=grid, mm_token_type_ids=types)]))
    return out


WORKLOADS = {"standard": standard, "long-tail": long_tail, "vision": vision}


def probabilities(prompts: list[Prompt], scores: list[torch.Tensor]) -> list[torch.Tensor]:
    """Softmax over each question's options (the rows from its type's offset on)."""
    out = []
    for prompt, rows in zip(prompts, scores):
        for question, row in zip(prompt.questions, rows):
            start = OFFSETS[question.type]
            out.append(torch.softmax(row[start: start + len(question.options)].double(), dim=-1))
    return out


def packs(prompts: list[Prompt], budget: int) -> list[list[Prompt]]:
    """Greedy packing in arrival order up to ``budget`` tokens of pack room (``Prompt.room``, as the worker's
    packer charges); a longer prompt runs alone."""
    out, current, used = [], [], 0
    for prompt in prompts:
        if current and used + prompt.room > budget:
            out.append(current)
            current, used = [], 0
        current.append(prompt)
        used += prompt.room
    return out + [current] if current else out


def padded_batches(prompts: list[Prompt], size: int = 64, max_padded: int = 65536) -> list[list[Prompt]]:
    """The reference path's batches: up to ``size`` prompts in arrival order, at most ``max_padded`` padded tokens."""
    out, current, longest = [], [], 0
    for prompt in prompts:
        wider = max(longest, prompt.length)
        if current and (len(current) == size or wider * (len(current) + 1) > max_padded):
            out.append(current)
            current, wider = [], prompt.length
        current.append(prompt)
        longest = wider
    return out + [current] if current else out


def warmup_batches(batches: list[list[Prompt]]) -> list[list[Prompt]]:
    """One batch of each distinct batch size: FlashQLA compiles a kernel variant per range of batch sizes on first
    use, which must not happen inside a timing."""
    seen: dict[int, list[Prompt]] = {}
    for batch in batches:
        seen.setdefault(len(batch), batch)
    return list(seen.values())


def precision(spec: str) -> dict:
    """Settings fields of a precision spec: ``bf16``, or ``fp8[+FAMILY...][@LAYERS]`` (``fp8+mlp@12-23``: FP8 for
    the MLPs of layers 12-23; --fp8-matrices and --fp8-layers)."""
    spec, _, layers = spec.partition("@")
    base, *families = spec.split("+")
    if base != "fp8":
        return {}
    return {"fp8": True, "fp8_matrices": ",".join(families) or "all", "fp8_layers": layers or "all"}
