"""FlashQLA called directly (worker/fast/qla.py) equals the same kernels reached through fla's dispatch, and
prepares each pack without waiting for the GPU.

Packs: many short sequences (no intra-card split), one long sequence and a few uneven ones (FlashQLA splits long
sequences across the card there), lengths off the 64-token chunk grid. Heads as in the 2B shape's linear layers.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("fla", reason="the fast engine needs flash-linear-attention")

from worker.fast.mixers import CudaMixers, boundaries_of  # noqa: E402
from worker.fast.qla import FlashQLA  # noqa: E402

try:
    FlashQLA()
except (ImportError, ValueError) as error:  # not installed, or no kernels for this GPU
    pytest.skip(f"FlashQLA does not run here: {error}", allow_module_level=True)

PACKS = {
    "32 x 512": [512] * 32,
    "one 8000": [8000],
    "uneven": [6000, 300, 1200, 1],
    "off the chunk grid": [37, 64, 65, 1000, 129, 2],
}
K_HEADS, V_HEADS, DIM = 16, 16, 128


def inputs(tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    q = F.normalize(randn(tokens, K_HEADS, DIM), dim=-1).bfloat16()
    k = F.normalize(randn(tokens, K_HEADS, DIM), dim=-1).bfloat16()
    v = randn(tokens, V_HEADS, DIM).bfloat16()
    g = F.logsigmoid(randn(tokens, V_HEADS) + 3)  # fp32, as the pre piece makes it
    beta = torch.sigmoid(randn(tokens, V_HEADS)).bfloat16()
    return q, k, v, g, beta


@pytest.mark.parametrize("name", list(PACKS))
@torch.inference_mode()
def test_direct_flash_qla_equals_fla_and_does_not_synchronise(name):
    lengths = PACKS[name]
    mixers = CudaMixers()
    assert mixers.flash_qla is not None
    q, k, v, g, beta = inputs(sum(lengths), seed=len(lengths))
    expected, _ = mixers._gdn(q[None], k[None], v[None], g[None], beta[None], initial_state=None,
                              output_final_state=False, cu_seqlens=boundaries_of(lengths, "cuda").cu_long)
    mixers.gated_delta(q, k, v, g, beta, boundaries_of(lengths, "cuda"))  # first call: JIT compilation may synchronise
    torch.cuda.synchronize()
    b = boundaries_of(lengths, "cuda")  # a fresh pack: its context is prepared in the call below
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = mixers.gated_delta(q, k, v, g, beta, b)
        again = mixers.gated_delta(q, k, v, g, beta, b)  # the pack's next layer reuses the context
    finally:
        torch.cuda.set_sync_debug_mode("default")
    split = mixers.flash_qla.context(b, V_HEADS).is_intra
    diff = (first.float() - expected[0].float()).abs().max().item()
    print("RESULT", {"pack": name, "intra_card_split": split, "max_diff_vs_fla": diff})
    assert first.shape == v.shape and torch.isfinite(first).all()
    assert diff == 0.0, f"the direct call differs from fla's dispatch of the same kernels by {diff}"
    assert torch.equal(first, again)


@pytest.mark.parametrize("heads", [16, 32, 48])  # the 2B and 4B shapes' value heads, and one more
def test_the_warm_up_packs_reach_every_variant_that_traffic_reaches(heads):
    """FlashQLA compiles a kernel variant per (split across the card or not, tile width) on first use: the packs
    the engine runs before it reports ready (CudaMixers.variant_packs) reach every variant that packs of standard
    and long-tail prompts up to the 16k budget reach, and single prompts over it (they run alone)."""
    import math
    import random

    budget, longest = 16384, 65536
    mixers = CudaMixers()
    warm = mixers.variant_packs(heads, budget, longest)
    assert all(sum(lengths) <= budget or len(lengths) == 1 for lengths in warm.values())
    assert all(mixers.flash_qla.variant(lengths, heads) == variant for variant, lengths in warm.items())
    rng = random.Random(heads)
    reached = {}
    for _ in range(3000):
        lengths: list[int] = []
        stop = rng.randint(1, 40)
        while len(lengths) < stop:
            n = rng.randint(256, 768) if rng.random() < 0.5 else int(
                min(budget, max(32, math.exp(rng.gauss(math.log(224), 1.82)))))
            if sum(lengths) + n > budget:
                break
            lengths.append(n)
        if rng.random() < 0.02:
            lengths = [rng.randint(budget + 1, longest)]
        reached.setdefault(mixers.flash_qla.variant(lengths or [budget], heads), lengths)
    missed = {variant: lengths for variant, lengths in reached.items() if variant not in warm}
    print("RESULT", {"heads": heads, "warmed": [str(v) for v in warm], "reached": [str(v) for v in reached]})
    assert not missed, f"traffic reaches variants the warm-up never runs: {missed}"
