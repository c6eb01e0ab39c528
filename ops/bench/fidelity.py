"""How far the fast path's answers move from an fp32 reference at a real shape, in bf16 and FP8 (random weights).

    python3 ops/bench/fidelity.py --shape 2b --requests 200 --out OUTDIR

The floor is the model's own sensitivity to rounding: the bf16 reference engine (transformers' forward) against
the fp32 reference (the same weights in fp32, with transformers' torch delta rule, fp32 throughout). Each fast-path
configuration runs eagerly (compile none, no graphs: the same kernels as served, without Inductor's fusion of the
rest) on the same questions. Per configuration: the largest and the mean per-question probability difference (the
largest over the question's options) and the argmax flip rate, against the fp32 reference and against bf16 fast.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity_set  # noqa: E402
from synthetic import WORKLOADS, packs, padded_batches, precision, probabilities, random_model  # noqa: E402

from worker.config import Settings
from worker.fast import FastEngine
from worker.model.reference import ReferenceEngine

CONFIGS = {  # name -> Settings fields of the fast engine
    "bf16": {},
    "fp8": {"fp8": True},
    "fp8-full": {"fp8": True, "fp8_layers": "full"},
    "fp8-linear": {"fp8": True, "fp8_layers": "linear"},
    "fp8-mlp": {"fp8": True, "fp8_matrices": "mlp"},
    "fp8-mlp-attn": {"fp8": True, "fp8_matrices": "mlp,attention"},  # linear-attention projections in bf16
}
# FP8-rounded weights in bf16 GEMMs (activations unrounded): one scale per output channel, as served, against one
# per 128x128 block (DeepSeek-V3's recipe), to see what block scales would buy before writing their kernels.
WEIGHT_ROUNDING = ("weights-rowwise", "weights-block128")
GATES = ("in_proj_b", "in_proj_a")  # kept bf16 by --fp8 too (worker/fast/fp8.py)


def compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> dict:
    """The fidelity set's measure (ops/bench/fidelity_set.py), rounded."""
    figures = fidelity_set.compare(got, want)
    return {"max": round(figures["max"], 4), "p99": round(figures["p99"], 4), "mean": round(figures["mean"], 4), "flips": round(figures["flips"], 4),
            "questions": figures["questions"]}


def reference(model, prompts) -> list[torch.Tensor]:
    engine, scores = ReferenceEngine(model), []
    for batch in padded_batches(prompts, size=32):
        scores += engine.forward(batch)
    return probabilities(prompts, scores)


@contextlib.contextmanager
def fp32_copy(model) -> Iterator:
    """The same weights in fp32, with transformers' own torch delta rule (fla's kernels compute in lower precision)
    and no TF32, while inside: the reference every fidelity figure is measured against."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    dispatched = qwen.torch_chunk_gated_delta_rule
    full = dataclasses.replace(model, model=copy.deepcopy(model.model).float())
    qwen.torch_chunk_gated_delta_rule = getattr(dispatched, "__wrapped__", dispatched)
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield full
    finally:
        qwen.torch_chunk_gated_delta_rule = dispatched
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
        del full
        torch.cuda.empty_cache()


def fp32_reference(model, prompts) -> list[torch.Tensor]:
    with fp32_copy(model) as full:
        return reference(full, prompts)


def fp8_rounded(weight: torch.Tensor, block: int | None) -> torch.Tensor:
    """``weight`` rounded to float8_e4m3fn with amax scales per output row (``block`` None) or per block x block
    tile, back in its dtype."""
    w = weight.float()
    if block is None:
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
        return ((w / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale).to(weight.dtype)
    rows, cols = w.shape
    padded = torch.nn.functional.pad(w, (0, -cols % block, 0, -rows % block))
    tiles = padded.view(padded.shape[0] // block, block, padded.shape[1] // block, block)
    scale = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-12) / 448.0
    rounded = (tiles / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return rounded.view(padded.shape)[:rows, :cols].to(weight.dtype)


def with_rounded_weights(model, block: int | None):
    """A copy of ``model`` whose decoder layers' projections (gates excepted) hold FP8-rounded weights."""
    copied = dataclasses.replace(model, model=copy.deepcopy(model.model))
    for name, module in copied.language_model.layers.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith(GATES):
            module.weight.data = fp8_rounded(module.weight.data, block)
    return copied


def fast(model, prompts, **fields) -> list[torch.Tensor]:
    engine = FastEngine(model, Settings(compile="none", cuda_graphs=False, prune_last=True, **fields))
    engine.warmup()
    scores = []
    for group in packs(prompts, engine.max_pack_tokens):
        scores += engine.launch(group).wait().scores
    return probabilities(prompts, scores)


@torch.inference_mode()
def measure(shape: str = "2b", requests: int = 200, configs: tuple[str, ...] = tuple(CONFIGS), seed: int = 0,
            log=print, sensitivity: str = "") -> dict:
    """-> {"floor": bf16 reference vs fp32, config: {"vs_fp32": ..., "vs_bf16": ...}}"""
    torch.manual_seed(seed)
    model = random_model(shape)
    prompts = [c for r in WORKLOADS["standard"](np.random.default_rng(seed), requests) for c in r.prompts]
    start = time.perf_counter()
    exact = fp32_reference(model, prompts)
    result = {"shape": shape, "questions": len(exact), "floor": compare(reference(model, prompts), exact)}
    log(f"fp32 and bf16 references: {time.perf_counter() - start:.1f}s; floor {result['floor']}")
    answers = {}

    def run(name: str, **fields) -> None:
        start = time.perf_counter()
        if name in WEIGHT_ROUNDING:
            rounded = with_rounded_weights(model, 128 if name.endswith("block128") else None)
            answers[name] = fast(rounded, prompts)
            del rounded
            torch.cuda.empty_cache()
        else:
            answers[name] = fast(model, prompts, **fields)
        result[name] = {"vs_fp32": compare(answers[name], exact), **fields}
        if name != "bf16" and "bf16" in answers:
            result[name]["vs_bf16"] = compare(answers[name], answers["bf16"])
        log(f"{name}: {time.perf_counter() - start:.1f}s {result[name]}")

    for name in configs:
        run(name, **(CONFIGS[name] if name in CONFIGS else precision(name)))
    if sensitivity and "bf16" in answers:
        # FP8 (``sensitivity`` matrices) in one layer at a time, against bf16 fast: the layers ranked by how far
        # they move the answers; then FP8 in the least sensitive quarter, half and three quarters of them.
        layers = len(model.language_model.layers)
        moved = {}
        for layer in range(layers):
            got = fast(model, prompts, fp8=True, fp8_layers=str(layer), fp8_matrices=sensitivity)
            moved[layer] = compare(got, answers["bf16"])["mean"]
        order = sorted(moved, key=moved.get)
        result["sensitivity"] = {"matrices": sensitivity, "mean_vs_bf16_per_layer": moved, "order": order}
        log(f"sensitivity ({sensitivity}), least first: {[(layer, moved[layer]) for layer in order]}")
        for share in (4, 2, 4 / 3):
            chosen = sorted(order[: round(layers / share)])
            run(f"fp8-{sensitivity.replace(',', '+')}-least-{len(chosen)}", fp8=True,
                fp8_layers=",".join(map(str, chosen)), fp8_matrices=sensitivity)
    return result


def table(result: dict) -> str:
    lines = ["| configuration (vs the fp32 reference) | max | mean | flips |", "|---|---|---|---|"]
    rows = [("bf16 reference (the floor)", result["floor"])]
    rows += [(f"fast path, {name}", figures["vs_fp32"]) for name, figures in result.items()
             if isinstance(figures, dict) and "vs_fp32" in figures]
    for label, figures in rows:
        lines.append(f"| {label} | {figures['max']:.3f} | {figures['mean']:.4f} | {figures['flips']:.1%} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="2b", choices=("0.8b", "2b", "4b"))
    parser.add_argument("--requests", type=int, default=200, help="standard requests (three questions each)")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join([*CONFIGS, *WEIGHT_ROUNDING])}, "
                        "or precision specs (fp8+mlp@12-23: synthetic.precision)")
    parser.add_argument("--sensitivity", default="", help="also rank the layers by FP8 sensitivity for these "
                        "matrices (all, mlp, ...; needs bf16 among the configs) and measure the least sensitive")
    parser.add_argument("--out", default="fidelity-results")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = measure(args.shape, args.requests, tuple(c for c in args.configs.split(",") if c),
                     sensitivity=args.sensitivity)
    (out / "fidelity.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "fidelity.md").write_text(table(result))
    print(table(result), flush=True)


if __name__ == "__main__":
    main()
