"""Per-pack micro-benchmark of the opt-in epilogue kernels (worker/fast/epilogues.py) at the 2B shape, bf16.

    python ops/bench/levers.py [--tokens 16384,8192,4096,2048,512] [--out results/]
    python ops/bench/levers.py --invariance [--out results/]

Each kernel against the path it replaces, which runs as the graphed pieces run it: the same function of
worker/fast/layers.py (or Ops call), torch.compile'd with static shapes around cuBLAS, once per token count. Both are
captured as CUDA graphs of ``--reps`` calls (cycling over ``--weights`` random weight sets, so that no layer's weights
sit in L2 from the call before) and replayed ``--replays`` times: the median per call in ms (CUDA events), and per 16k
pack summed over the layers that run it (24 MLPs, 24 residual pairs: out_proj or o_proj then down, 18 gated norms),
scaled to 16,384 tokens at smaller token counts. Max differences: against the current path's output and both
against fp32. The GEMM table times cuBLAS's gate/up GEMM alone and the fused kernel in each configuration (TFLOP/s:
2 M N K over the time; the fused kernel pays if it is at least as fast as cuBLAS's GEMM plus the SwiGLU pass).
Last, post_linear whole (gated norm, out_proj, residual, MLP) with none and all of them at the largest count
(``--no-piece``: not). The fused GEMM needs TMA (Hopper); elsewhere its rows are left out.

``--invariance``: in deterministic mode's process settings (worker/fast/deterministic.py), each kernel on rows laid
elsewhere at every token count must give the bits it gives at the largest (as deterministic.check_gemms asks of cuBLAS).

Needs torch and Triton only: worker/fast's torch-only modules are loaded by path (importing the worker package would
import transformers).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch._dynamo
import torch.nn.functional as F

HIDDEN, INNER, V_HEADS, HEAD_V, EPS = 2048, 6144, 16, 128, 1e-6  # the 2B shape (ops/bench/synthetic.py)
LAYERS = {"swiglu": 24, "residual": 24, "gated_norm": 18}  # layers that run each, per pack
PACK = 16384
DEVICE = "cuda"


def fast_modules() -> types.SimpleNamespace:
    here = Path(__file__).resolve().parents[2] / "worker" / "fast"
    package = types.ModuleType("_dq_fast")
    package.__path__ = [str(here)]
    sys.modules["_dq_fast"] = package
    return types.SimpleNamespace(**{name: importlib.import_module(f"_dq_fast.{name}")
                                    for name in ("ops", "layers", "epilogues", "deterministic")})


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(torch.bfloat16)


def per_call_ms(call, reps: int, replays: int) -> float:
    """``call(i)`` for i in range(reps) captured as one CUDA graph (after a warm-up on a side stream, which
    compiles), replayed: the median time per call."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(reps):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            call(i)
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / reps)
    del graph
    return statistics.median(times)


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


class Bench:
    def __init__(self, m: types.SimpleNamespace, args: argparse.Namespace) -> None:
        self.m, self.args = m, args
        ops = m.ops
        self.plain = ops.Ops()
        self.lever = {name: m.epilogues.epilogue_ops(self.plain, torch.device(DEVICE), **{name: True})
                      for name in LAYERS}
        self.every = m.epilogues.epilogue_ops(self.plain, torch.device(DEVICE), **dict.fromkeys(LAYERS, True))
        sets = args.weights
        self.mlps = [m.layers.Mlp(randn(HIDDEN, scale=0.1), ops.Dense(randn(2 * INNER, HIDDEN, scale=HIDDEN ** -0.5)),
                                  ops.Dense(randn(HIDDEN, INNER, scale=INNER ** -0.5))) for _ in range(sets)]
        value = V_HEADS * HEAD_V
        self.out_projs = [ops.Dense(randn(HIDDEN, value, scale=value ** -0.5)) for _ in range(sets)]
        self.norms = [randn(HIDDEN, scale=0.1) for _ in range(sets)]
        self.out_norms = [1 + randn(HEAD_V, scale=0.1) for _ in range(sets)]
        self.compiled: dict = {}
        self.rows: list[str] = []
        self.gemm_rows: list[str] = []

    def compile(self, name: str, fn):
        """One torch.compile per function and variant, static shapes: it recompiles per token count, as the
        graphed pieces do per bucket."""
        return self.compiled.setdefault(name, torch.compile(fn, dynamic=False))

    def time(self, call) -> float:
        return per_call_ms(call, self.args.reps, self.args.replays)

    def row(self, tokens: int, lever: str, current: float, fused: float, against_current: float | None = None,
            errors: tuple[float, float] | None = None, label: str = "") -> None:
        scale = LAYERS[lever] * PACK / tokens
        diffs = "| |" if errors is None else f"{against_current:.3g} | {errors[0]:.3g} / {errors[1]:.3g} |"
        self.rows.append(f"| {tokens} | {label or lever} | {current:.4f} | {fused:.4f} | {current - fused:+.4f} | "
                         f"{(current - fused) * scale:+.2f} | {diffs}")
        print(self.rows[-1], flush=True)

    def swiglu(self, tokens: int) -> None:
        m, sets = self.m, self.args.weights
        normed = [randn(tokens, HIDDEN) for _ in range(sets)]
        fn = self.compile("gate_up", m.layers.gate_up)
        current = self.time(lambda i: fn(self.plain, self.mlps[i % sets], normed[i % sets]))
        fused = self.time(lambda i: fn(self.lever["swiglu"], self.mlps[i % sets], normed[i % sets]))
        want, got = fn(self.plain, self.mlps[0], normed[0]), fn(self.lever["swiglu"], self.mlps[0], normed[0])
        gate, up = (normed[0].double() @ self.mlps[0].gate_up.weight.double().T).float().chunk(2, dim=-1)
        exact = F.silu(gate) * up
        self.row(tokens, "swiglu", current, fused, gap(got, want), (gap(want, exact), gap(got, exact)))
        flops, first = 2 * tokens * 2 * INNER * HIDDEN, len(self.gemm_rows)
        cublas = self.time(lambda i: F.linear(normed[i % sets], self.mlps[i % sets].gate_up.weight))
        self.gemm_rows.append(f"| {tokens} | cuBLAS gate/up GEMM alone | {cublas:.4f} | {flops / cublas / 1e9:.0f} | "
                              f"100% |")
        self.gemm_rows.append(f"| {tokens} | current: GEMM + SwiGLU (compiled) | {current:.4f} | "
                              f"{flops / current / 1e9:.0f} | {cublas / current:.0%} |")
        chosen = m.epilogues.config_for(tokens, False)
        for name, config in m.epilogues.CONFIGS.items():
            if (self.args.configs and name not in self.args.configs) or not m.epilogues._tma(normed[0].device):
                continue
            ms = self.time(lambda i, config=config: m.epilogues.run_gate_up_swiglu(
                normed[i % sets], self.mlps[i % sets].gate_up.weight, config))
            mark = " (chosen)" if config == chosen else ""
            mark += " (deterministic)" if name == m.epilogues.INVARIANT else ""
            self.gemm_rows.append(f"| {tokens} | fused {name}{mark} | {ms:.4f} | {flops / ms / 1e9:.0f} | "
                                  f"{cublas / ms:.0%} |")
        for line in self.gemm_rows[first:]:
            print(line, flush=True)

    def residual(self, tokens: int) -> None:
        """A pair: out_proj (or o_proj, the same shape) then down, each followed by the norm that reads its sum."""
        hidden = randn(tokens, HIDDEN)
        pair = [self.residual_one(hidden, weights) for weights in (self.out_projs, [mlp.down for mlp in self.mlps])]
        current, fused, addmm = (sum(part[n] for part in pair) for n in range(3))
        against, error_current, error_fused = (max(part[n] for part in pair) for n in range(3, 6))
        self.row(tokens, "residual", current, fused, against, (error_current, error_fused),
                 label="residual (out_proj + down)")
        self.row(tokens, "residual", current, addmm, label="(residual as torch.addmm, compiled)")

    def residual_one(self, hidden: torch.Tensor, weights: list) -> tuple[float, ...]:
        """-> ms per call (current, kernel, torch.addmm), max diff against current, max errors against fp32."""
        m, sets = self.m, self.args.weights

        def add_norm(ops, hidden, inputs, weights, norm):
            updated = ops.add_linear(hidden, inputs, weights)
            return updated, ops.rms_norm(updated, norm, EPS)

        def addmm_norm(hidden, inputs, weight, norm):  # torch.addmm as written: for reference
            updated = torch.addmm(hidden, inputs, weight.t())
            return updated, m.ops.rms_norm(updated, norm, EPS)

        fn, fn_addmm = self.compile("add_norm", add_norm), self.compile("addmm_norm", addmm_norm)
        inputs = [randn(hidden.shape[0], weights[0].weight.shape[1]) for _ in range(sets)]
        state = hidden.clone()  # updated in place by the kernel, call after call
        current = self.time(lambda i: fn(self.plain, hidden, inputs[i % sets], weights[i % sets], self.norms[i % sets]))
        fused = self.time(lambda i: fn(self.lever["residual"], state, inputs[i % sets], weights[i % sets],
                                       self.norms[i % sets]))
        addmm = self.time(lambda i: fn_addmm(hidden, inputs[i % sets], weights[i % sets].weight, self.norms[i % sets]))
        want = fn(self.plain, hidden, inputs[0], weights[0], self.norms[0])[0]
        got = fn(self.lever["residual"], hidden.clone(), inputs[0], weights[0], self.norms[0])[0]
        exact = (hidden.double() + inputs[0].double() @ weights[0].weight.double().T).float()
        return current, fused, addmm, gap(got, want), gap(want, exact), gap(got, exact)

    def gated_norm(self, tokens: int) -> None:
        sets = self.args.weights
        o = [randn(tokens, V_HEADS, HEAD_V) for _ in range(sets)]
        z = [randn(tokens, V_HEADS * HEAD_V) for _ in range(sets)]

        def norm(ops, o, z, weight, target):
            return ops.gated_norm(o, z, weight, EPS, target)

        fn = self.compile("gated_norm", norm)
        current = self.time(lambda i: fn(self.plain, o[i % sets], z[i % sets], self.out_norms[i % sets],
                                         self.out_projs[i % sets]))
        fused = self.time(lambda i: fn(self.lever["gated_norm"], o[i % sets], z[i % sets], self.out_norms[i % sets],
                                       self.out_projs[i % sets]))
        args = (o[0], z[0], self.out_norms[0], self.out_projs[0])
        want, got = fn(self.plain, *args), fn(self.lever["gated_norm"], *args)
        of = o[0].float()
        exact = (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + EPS) * self.out_norms[0].float()
                 * F.silu(z[0].float()).view_as(of)).reshape(tokens, -1)
        self.row(tokens, "gated_norm", current, fused, gap(got, want), (gap(want, exact), gap(got, exact)))

    def piece(self, tokens: int) -> str:
        """post_linear whole, none of the kernels against all of them."""
        m, sets = self.m, self.args.weights
        dims = m.layers.LinearDims(V_HEADS * HEAD_V, V_HEADS * HEAD_V, V_HEADS, V_HEADS, HEAD_V, HEAD_V, EPS)
        unused = torch.zeros(1, device=DEVICE, dtype=torch.bfloat16)
        weights = [m.layers.LinearAttn(unused, m.ops.Dense(unused), unused, unused, unused, self.out_norms[i],
                                       self.out_projs[i], self.mlps[i]) for i in range(sets)]
        o = randn(tokens, V_HEADS, HEAD_V)
        z = randn(tokens, V_HEADS * HEAD_V)
        hidden = randn(tokens, HIDDEN)
        state = hidden.clone()
        fn = self.compile("post_linear", m.layers.post_linear)
        current = self.time(lambda i: fn(self.plain, dims, weights[i % sets], hidden, o, z))
        fused = self.time(lambda i: fn(self.every, dims, weights[i % sets], state, o, z))
        return (f"post_linear whole at {tokens} tokens: {current:.4f} ms without the kernels, {fused:.4f} ms with "
                f"all three ({current - fused:+.4f} ms per linear layer)")


def invariance(m: types.SimpleNamespace, sizes: list[int]) -> list[str]:
    """Rows laid elsewhere at every size against the largest size's result, bitwise."""
    most = max(sizes)
    mlp = m.layers.Mlp(randn(HIDDEN), m.ops.Dense(randn(2 * INNER, HIDDEN, scale=HIDDEN ** -0.5)),
                       m.ops.Dense(randn(HIDDEN, INNER, scale=INNER ** -0.5)))
    normed, inputs, hidden = randn(most, HIDDEN), randn(most, INNER), randn(most, HIDDEN)
    o, z, weight = randn(most, V_HEADS, HEAD_V), randn(most, V_HEADS * HEAD_V), 1 + randn(HEAD_V, scale=0.1)
    ep = m.epilogues

    def added(rows):
        updated = hidden[rows].clone()
        ep.add_linear_(updated, inputs[rows], mlp.down.weight)
        return updated

    kernels = {
        "SwiGLU GEMM, deterministic mode's configuration": lambda rows: ep.gate_up_swiglu(normed[rows],
                                                                                          mlp.gate_up.weight, True),
        "SwiGLU GEMM, configurations by token count (default mode)": lambda rows: ep.gate_up_swiglu(
            normed[rows], mlp.gate_up.weight, False),
        "residual: cuBLAS beta=1 in place (down projection)": added,
        "gated norm": lambda rows: ep.gated_rms_norm(o[rows], z[rows], weight, EPS),
        "(cuBLAS gate/up GEMM, for reference)": lambda rows: F.linear(normed[rows], mlp.gate_up.weight),
    }
    lines = ["| kernel | token counts | bitwise equal at every count | max difference |", "|---|---|---|---|"]
    everything = torch.arange(most, device=DEVICE)
    for name, kernel in kernels.items():
        reference, worst, unequal = kernel(everything), 0.0, []
        for size in sorted(sizes)[:-1]:
            rows = torch.arange(size, device=DEVICE) + (most - size) // 2 + 1  # elsewhere than in the reference
            got = kernel(rows)
            if not torch.equal(got, reference[rows]):
                unequal.append(str(size))
                worst = max(worst, gap(got, reference[rows]))
        lines.append(f"| {name} | {','.join(map(str, sorted(sizes)))} | "
                     f"{'yes' if not unequal else 'no, at ' + ','.join(unequal)} | {worst:g} |")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="16384,8192,4096,2048,512")
    parser.add_argument("--levers", default=",".join(LAYERS), help="some of " + ", ".join(LAYERS))
    parser.add_argument("--configs", default="", help="the fused GEMM's configurations to time (default: all)")
    parser.add_argument("--reps", type=int, default=8, help="calls per captured graph")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--weights", type=int, default=4, help="random weight sets the calls cycle over")
    parser.add_argument("--no-piece", dest="piece", action="store_false")
    parser.add_argument("--invariance", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.configs = [c for c in args.configs.split(",") if c]
    tokens = [int(t) for t in args.tokens.split(",") if t]
    began = time.perf_counter()
    m = fast_modules()
    torch.manual_seed(0)
    header = [(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
               f"{importlib.import_module('triton').__version__}; 2B shape (hidden {HIDDEN}, MLP {INNER}, "
               f"{V_HEADS} value heads of {HEAD_V}), bf16")]
    if args.invariance:
        m.deterministic.enable()  # before the first GPU matmul: cuBLAS without split-K, as deterministic mode runs
        with torch.inference_mode():
            lines = header + ["", *invariance(m, tokens)]
        name = "levers_invariance.md"
    else:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit,
                                                                512)
        bench = Bench(m, args)
        piece = None
        with torch.inference_mode():
            for count in tokens:
                for lever in args.levers.split(","):
                    getattr(bench, lever.strip())(count)
            if args.piece:
                piece = bench.piece(max(tokens))
                print(piece, flush=True)
        intro = (f"medians of {args.replays} replays of {args.reps} calls, over {args.weights} weight sets; per 16k "
                 f"pack: the saving per call x the layers that run it x 16384 / tokens")
        columns = ("| tokens | lever | current ms | lever ms | saved ms per call | saved ms per 16k pack | max diff vs "
                   "current | max err vs fp32 (current / lever) |")
        gemms = (f"GEMMs M x {2 * INNER} x {HIDDEN}: the fused kernel pays where its share of cuBLAS's rate beats the "
                 f"current path's (GEMM + SwiGLU)")
        lines = [*header, intro, "", columns, "|---|---|---|---|---|---|---|---|", *bench.rows, "", gemms, "",
                 "| tokens | GEMM | ms | TFLOP/s | cuBLAS's GEMM time / this |", "|---|---|---|---|---|",
                 *bench.gemm_rows]
        lines += ["", piece] if piece else []
        name = "levers.md"
    lines += ["", f"({time.perf_counter() - began:.0f} s in all)"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / name).write_text(text)


if __name__ == "__main__":
    main()
