"""Host and GPU time of the gated delta rule per pack: through fla's dispatch against FlashQLA called directly.

    python ops/bench/delta_rule.py [--layers 18] [--packs 20] [--out results/]

A pack is a fresh set of boundaries and ``--layers`` calls on it, as the fast engine makes them (18 linear layers
in the 2B shape, its heads). Host: seconds until the last call returns, without waiting for the GPU; that is
what a pack costs the GPU thread, and at low load what a pack's latency cannot go below. Wall: until the GPU is
done. GPU: CUDA event time of the same calls. Medians over ``--packs`` packs, after one warm-up pack per shape.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from worker.fast.layout import boundaries_of  # noqa: E402
from worker.fast.mixers import CudaMixers  # noqa: E402

SHAPES = {  # name -> chunk lengths of one pack
    "16k: 32 x 512": [512] * 32,
    "2k: 4 x 512": [512] * 4,
    "600: 1 x 600": [600],
    "8k: 1 x 8000": [8000],
}
K_HEADS, V_HEADS, DIM = 16, 16, 128


def one_pack(call, lengths: list[int], inputs: tuple, layers: int) -> tuple[float, float, float]:
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start = time.perf_counter()
    b = boundaries_of(lengths, "cuda")
    begin.record()
    for _ in range(layers):
        call(*inputs, b)
    end.record()
    host = time.perf_counter() - start
    end.synchronize()
    return host, time.perf_counter() - start, begin.elapsed_time(end) / 1e3


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=18)
    parser.add_argument("--packs", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    direct = CudaMixers()
    if direct.flash_qla is None:
        sys.exit("FlashQLA does not run here: nothing to compare")
    via_fla = CudaMixers()
    via_fla.flash_qla = None
    lines = [f"{torch.cuda.get_device_name()}, {args.layers} delta-rule calls per pack, {K_HEADS} key and "
             f"{V_HEADS} value heads of {DIM}; medians of {args.packs} packs, ms per pack", "",
             "| pack | path | host | wall | GPU |", "|---|---|---|---|---|"]
    for name, lengths in SHAPES.items():
        tokens = sum(lengths)
        q, k = (F.normalize(torch.randn(tokens, K_HEADS, DIM, device="cuda"), dim=-1).bfloat16() for _ in "qk")
        v = torch.randn(tokens, V_HEADS, DIM, device="cuda").bfloat16()
        g = F.logsigmoid(torch.randn(tokens, V_HEADS, device="cuda") + 3)
        beta = torch.sigmoid(torch.randn(tokens, V_HEADS, device="cuda")).bfloat16()
        for path, mixers in (("fla dispatch", via_fla), ("FlashQLA direct", direct)):
            one_pack(mixers.gated_delta, lengths, (q, k, v, g, beta), args.layers)  # JIT, caches
            runs = [one_pack(mixers.gated_delta, lengths, (q, k, v, g, beta), args.layers)
                    for _ in range(args.packs)]
            host, wall, gpu = (statistics.median(r[i] for r in runs) * 1e3 for i in range(3))
            lines.append(f"| {name} | {path} | {host:.1f} | {wall:.1f} | {gpu:.1f} |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "delta_rule.md").write_text(text)


if __name__ == "__main__":
    main()
