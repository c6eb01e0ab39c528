"""In-process benchmark of the fast engine against the padded reference engine, on random weights at real shapes.

    python ops/bench/fast_path.py --runs 2b:standard:bf16,2b:standard:fp8 --out results/

Each run builds the model, the engine (timing compilation and graph capture), warms it up, then feeds it packs
formed greedily up to its budget, launching pack n+1 before waiting for pack n, as the daemon does. It reports
tokens/s and requests/s, pack fill (real tokens over computed rows), peak GPU memory (model included), and the
reference engine's figures on the same requests with the ratio. ``--profile`` adds a kernel-time breakdown of
one run. Results go to ``results.jsonl`` and ``summary.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from synthetic import (WORKLOADS, packs, padded_batches, precision, probabilities, random_model,  # noqa: E402
                       warmup_batches)

from worker.config import Settings  # noqa: E402
from worker.fast import FastEngine  # noqa: E402
from worker.model.engine import Engine  # noqa: E402
from worker.model.reference import ReferenceEngine  # noqa: E402

COUNTS = {"standard": 1200, "long-tail": 1500, "vision": 800}  # requests timed per run (about 0.4-0.6M tokens)
REF_COUNTS = {"standard": 256, "long-tail": 320, "vision": 192}


def timed(engine: Engine, groups: list[list]) -> tuple[float, int]:
    """Seconds for ``groups`` through ``engine``, launching pack n+1 before waiting for pack n (as the daemon), and
    the tokens its packs computed (their bucket sizes: the pack fill's denominator)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    pending = None
    capacity = 0
    for group in groups:
        launched = engine.launch(group)
        if pending is not None:
            capacity += pending.wait().capacity
        pending = launched
    if pending is not None:
        capacity += pending.wait().capacity
    sync()
    return time.perf_counter() - start, capacity


def reference_figures(model, prompts) -> dict:
    engine = ReferenceEngine(model)
    batches = padded_batches(prompts)
    for batch in warmup_batches(batches):  # kernel compilation and cuBLAS set-up outside the timing
        engine.forward(batch)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for batch in batches:
        engine.forward(batch)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(c.length for c in prompts)
    padded = sum(len(b) * max(c.length for c in b) for b in batches)
    return {"ref_tokens_per_s": tokens / seconds, "ref_requests_per_s": len(prompts) / seconds,
            "ref_padding": 1 - tokens / padded}


def categorize(name: str) -> str:
    # Order matters: inductor's kernel names list the fused ops ("_scaled_mm" for a fused quantisation),
    # FlashQLA's contain "flash", FlashAttention's mention cutlass types.
    lowered = name.lower()
    if lowered.startswith(("_short_conv", "_swiglu_quant", "_gated_rms_norm_quant")):
        return "fused (the project's Triton kernels)"
    if lowered.startswith("triton_"):
        return "fused element-wise (inductor Triton)"
    if any(k in lowered for k in ("flash_qla", "fused_gdr", "kkt", "tilelang", "chunk_", "gated_delta",
                                  "recompute_w_u", "solve_tril", "l2norm", "wy_", "cumsum", "merge_16x16")):
        return "gated delta rule (fla / FlashQLA)"
    if "flash" in lowered or "fmha" in lowered or "attn" in lowered:
        return "varlen attention (FlashAttention)"
    if any(k in lowered for k in ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "scaled_mm", "f8f8")):
        return "GEMM (cuBLAS/CUTLASS)"
    if "memcpy" in lowered or "memset" in lowered or "copy" in lowered:
        return "copies"
    return "other (eager element-wise, embedding, indexing)"


def profile(engine: FastEngine, groups: list[list]) -> dict:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed(engine, groups)
    totals: dict[str, float] = defaultdict(float)
    kernels: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if device_us <= 0 or not str(event.device_type).endswith("CUDA"):  # kernels and copies only
            continue
        totals[categorize(event.key)] += device_us
        kernels[event.key] += device_us
    tokens = sum(c.length for g in groups for c in g)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    ordered = sorted(totals.items(), key=lambda kv: -kv[1])
    return {"per_16k_tokens_ms": {k: v / 1000 * 16384 / tokens for k, v in ordered},
            "top_kernels_ms": [(k[:90], v / 1000) for k, v in top], "profiled_tokens": tokens}


def run_one(spec: str, args: argparse.Namespace, cache: dict) -> dict:
    shape, workload, dtype, *rest = spec.split(":")
    variant = rest[0] if rest else "default"  # default | eager | nograph
    key = (shape, workload == "vision")
    if cache.get("key") != key:
        cache.clear()
        gc.collect()
        torch.cuda.empty_cache()
        cache["key"], cache["model"] = key, random_model(shape, multimodal=workload == "vision")
    model = cache["model"]
    rng = np.random.default_rng(0)
    requests = WORKLOADS[workload](rng, COUNTS[workload] if not args.quick else 64)
    prompts = [c for r in requests for c in r.prompts]
    compile_mode = {"default": "layer", "nograph": "layer", "eager": "none"}[variant]
    fp8 = precision(dtype)  # bf16, fp8, fp8+mlp, fp8+mlp@12-23 ... (synthetic.precision)
    # Without deterministic mode: its switches are the process's, and the runs here share one process (its figure
    # in process is end_to_end.py's, whose worker runs the defaults).
    settings = Settings(compile=compile_mode, cuda_graphs=variant == "default", prune_last=True,
                        buckets=args.buckets, pack_tokens=args.pack_tokens, deterministic=False, **fp8)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    engine = FastEngine(model, settings)
    built = time.perf_counter() - start
    engine.warmup()
    groups = packs(prompts, engine.max_pack_tokens)
    timed(engine, groups[: max(2, len(groups) // 10)])  # first real packs: allocator and autotuning settle
    seconds, capacity = timed(engine, groups)
    tokens = sum(c.length for c in prompts)
    result = {"run": spec, "shape": shape, "workload": workload, "dtype": dtype, "variant": variant,
              "compile": compile_mode, "graphs": engine.graphs_on, "requests": len(requests),
              "tokens": tokens, "packs": len(groups), "tokens_per_s": tokens / seconds,
              "requests_per_s": len(requests) / seconds, "pack_fill": tokens / capacity,
              "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
              "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
              "setup_s": round(built, 1), "capture_s": round(engine.capture_seconds, 1),
              "warmup_s": round(engine.compile_seconds, 1)}
    sample = [c for g in groups[:4] for c in g]
    probs = probabilities(sample, [s for g in groups[:4] for s in engine.launch(g).wait().scores])
    if fp8 and (shape, workload) in cache.get("bf16_probs", {}):
        pairs = list(zip(probs, cache["bf16_probs"][(shape, workload)]))
        result["fp8_vs_bf16_max_prob_diff"] = max(float((a - b).abs().max()) for a, b in pairs)
        result["fp8_vs_bf16_flip_rate"] = sum(int(a.argmax() != b.argmax()) for a, b in pairs) / len(pairs)
        result["fp8_vs_bf16_questions"] = len(pairs)
    if dtype == "bf16" and variant == "default":
        cache.setdefault("bf16_probs", {})[(shape, workload)] = probs
    if spec in args.profile.split(","):
        result["profile"] = profile(engine, groups[:8])
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    cache.setdefault("requests", {})[(shape, workload)] = requests
    return result


def add_reference(result: dict, cache: dict) -> None:
    """The reference engine on the first requests of the same run (same model, same order), and the ratio."""
    shape, workload = result["shape"], result["workload"]
    key = ("ref", workload, shape)
    if key not in cache:
        requests = cache["requests"][(shape, workload)]
        prompts = [c for r in requests[: REF_COUNTS[workload]] for c in r.prompts]
        torch.cuda.reset_peak_memory_stats()
        cache[key] = reference_figures(cache["model"], prompts)
        cache[key]["ref_peak_gpu_gib"] = torch.cuda.max_memory_allocated() / 2**30
    result.update(cache[key])
    result["speedup_vs_reference"] = result["tokens_per_s"] / result["ref_tokens_per_s"]


def summary(results: list[dict]) -> str:
    lines = ["| run | tokens/s | requests/s | pack fill | peak GPU GiB | reference tokens/s | ratio | setup+warmup s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['run']} | failed: {r['error'][:80]} |||||||")
            continue
        ref = r.get("ref_tokens_per_s")
        ref_text = f"{ref / 1e3:.1f}k" if ref else "-"
        ratio = f"{r['speedup_vs_reference']:.2f}x" if ref else "-"
        setup = r["setup_s"] + r["warmup_s"] + r["capture_s"]
        lines.append(f"| {r['run']} | {r['tokens_per_s'] / 1e3:.1f}k | {r['requests_per_s']:.0f} | "
                     f"{r['pack_fill']:.1%} | {r['peak_gpu_gib']:.1f} | {ref_text} | {ratio} | {setup:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="2b:standard:bf16,2b:standard:fp8",
                        help="comma-separated shape:workload:dtype[:variant] (dtype: bf16, fp8, fp8+mlp, "
                             "fp8+mlp+attention@12-23 ...; variant: default, nograph, eager)")
    parser.add_argument("--buckets", default=Settings().buckets, help="the engine's --buckets")
    parser.add_argument("--pack-tokens", type=int, default=16384)
    parser.add_argument("--profile", default="", help="the runs to profile (comma-separated)")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--quick", action="store_true", help="64 requests per run (smoke test)")
    parser.add_argument("--deadline-s", type=float, default=0.0, help="skip the remaining runs after this long")
    parser.add_argument("--out", default="bench-results")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    print(f"device: {device}, torch {torch.__version__}", flush=True)
    try:
        import flash_qla  # noqa: F401

        qla = True
    except ImportError:
        qla = False
    print(f"FlashQLA installed: {qla}", flush=True)
    begin, results, cache = time.perf_counter(), [], {}

    def record() -> None:
        with open(out / "results.jsonl", "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in results)
        (out / "summary.md").write_text(summary(results))

    def add_references() -> None:
        """The reference engine for the runs of the loaded model, after its fast runs and before the next model
        replaces it, so that every shape and workload gets its ratio (past the deadline, none is started)."""
        for result in results:
            if args.no_reference or "error" in result or "ref_tokens_per_s" in result or \
                    (result["shape"], result["workload"] == "vision") != cache.get("key"):
                continue
            if args.deadline_s and time.perf_counter() - begin > args.deadline_s:
                result["reference_error"] = "skipped: deadline"
                continue
            try:
                add_reference(result, cache)
            except Exception as error:
                result["reference_error"] = f"{type(error).__name__}: {error}"
            print("RESULT", json.dumps(result), flush=True)
            record()

    for spec in [s for s in args.runs.split(",") if s]:
        parts = spec.split(":")
        if cache.get("key") not in (None, (parts[0], parts[1:2] == ["vision"])):
            add_references()  # the next run loads another model
        if args.deadline_s and time.perf_counter() - begin > args.deadline_s:
            results.append({"run": spec, "error": "skipped: deadline"})
            continue
        try:
            result = run_one(spec, args, cache)
        except Exception as error:  # one failed run must not lose the others' figures
            import traceback

            traceback.print_exc()
            result = {"run": spec, "error": f"{type(error).__name__}: {error}"}
        result.update(device=device, flash_qla=qla, torch=torch.__version__)
        results.append(result)
        print("RESULT", json.dumps(result), flush=True)
        record()
    add_references()
    print(summary(results), flush=True)


if __name__ == "__main__":
    main()
