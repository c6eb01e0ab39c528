"""The opt-in epilogue kernels (worker/fast/epilogues.py) on the GPU against their unfused PyTorch forms in bf16, at
the 2B shape: alone (every GEMM configuration), inside compiled pieces replayed as CUDA graphs, and a row's bits
whatever the token count (deterministic mode's configuration; the gated norm)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from worker.fast import epilogues, fused, layers, ops  # noqa: E402
from worker.fast.forward import compile_piece  # noqa: E402
from worker.fast_options import EPILOGUES  # noqa: E402
from worker.fast.graphs import post_full_into, post_linear_into, pre_linear_into  # noqa: E402

bf16 = torch.bfloat16
EPS = 1e-6
HIDDEN, INNER = 2048, 6144  # the 2B shape
hopper = pytest.mark.skipif(torch.cuda.get_device_capability() < (9, 0), reason="the GEMM kernel needs TMA (Hopper)")


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(bf16)


def steps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Each element's difference in bf16 steps of ``want`` (values under a 64th of the largest counted at that
    size: a sum that cancels keeps its addends' rounding)."""
    want = want.float()
    size = want.abs().clamp_min(want.abs().max().item() / 64 + 2.0 ** -100)
    return (got.float() - want).abs() / 2.0 ** (torch.floor(torch.log2(size)) - 7)


def swiglu_of(product: torch.Tensor) -> torch.Tensor:
    gate, up = product.float().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


@hopper
@pytest.mark.parametrize("config", sorted(epilogues.CONFIGS))
@pytest.mark.parametrize("tokens", [1, 300, 4096])
def test_gate_up_swiglu_against_the_unfused_form(config, tokens):
    """Against cuBLAS's GEMM rounded to bf16, then SwiGLU in fp32 (what the compiled path computes): the kernel
    sums K in another order, so a product moves by a bf16 step now and then, never more; as close to the fp32
    result as the unfused path is."""
    x, weight = randn(tokens, HIDDEN), randn(2 * INNER, HIDDEN, scale=HIDDEN ** -0.5)
    got = epilogues.run_gate_up_swiglu(x, weight, epilogues.CONFIGS[config])
    unfused = swiglu_of(F.linear(x, weight)).to(bf16)
    exact = swiglu_of(x.double() @ weight.double().T)  # float64: whatever TF32 setting an earlier test left
    steps = steps_apart(got, unfused)
    assert torch.isfinite(got).all() and steps.max().item() <= 3 and (steps > 0).float().mean().item() < 0.05
    assert (got.float() - exact).abs().max() <= 1.5 * (unfused.float() - exact).abs().max() + 1e-3
    assert torch.equal(epilogues.gate_up_swiglu(x, weight, True), epilogues.run_gate_up_swiglu(
        x, weight, epilogues.CONFIGS[epilogues.INVARIANT]))


@hopper
def test_gate_up_swiglu_rows_have_the_same_bits_at_every_token_count():
    """Deterministic mode's configuration: each row alone in any bucket as in the largest, wherever it lies."""
    most = 8192
    rows, weight = randn(most, HIDDEN), randn(2 * INNER, HIDDEN, scale=HIDDEN ** -0.5)
    reference = epilogues.gate_up_swiglu(rows, weight, True)
    for size in (1, 7, 512, 2048, 4096, 5000):
        order = torch.arange(size, device="cuda") + (most - size) // 2 + 1
        assert torch.equal(epilogues.gate_up_swiglu(rows[order], weight, True), reference[order]), size


@pytest.mark.parametrize("heads", [16, 32])
def test_gated_rms_norm_equals_the_pytorch_form_at_every_token_count(heads, dim=128):
    o = randn(4096, heads, dim)
    z = randn(4096, heads * dim + 40)[:, 8: 8 + heads * dim]  # strided: a view of the in-projection
    weight = (1 + 0.1 * torch.randn(dim, device="cuda")).to(bf16)
    got = epilogues.gated_rms_norm(o, z, weight, EPS)
    # The sum of squares in another order: now and then a rounding flips, and the one after it.
    steps = steps_apart(got, ops.gated_norm(o, z, weight, EPS))
    assert steps.max().item() <= 2 and (steps > 0).float().mean().item() < 0.01
    for size in (1, 300, 2048):
        assert torch.equal(epilogues.gated_rms_norm(o[-size:], z[-size:], weight, EPS), got[-size:]), size


@pytest.mark.parametrize("inner", [HIDDEN, INNER])
def test_add_linear_is_the_unfused_sum_in_place(inner, tokens=1000):
    """No worse than adding after the GEMM (cuBLAS's bf16 beta = 1 rounds the product first too: an H100 gives the
    unfused path's bits), without the extra pass over the hidden state."""
    hidden, x, weight = randn(tokens, HIDDEN), randn(tokens, inner), randn(HIDDEN, inner, scale=inner ** -0.5)
    exact = (hidden.double() + x.double() @ weight.double().T).float()
    updated = hidden.clone()
    epilogues.add_linear_(updated, x, weight)
    unfused = hidden + F.linear(x, weight)  # rounds the product, then the sum
    assert steps_apart(updated, unfused).max().item() <= 1
    assert (updated.float() - exact).abs().max() <= (unfused.float() - exact).abs().max()


def _dims(k_heads: int = 2, v_heads: int = 4, dim: int = 128) -> layers.LinearDims:
    return layers.LinearDims(k_heads * dim, v_heads * dim, k_heads, v_heads, dim, dim, EPS)


def _mlp(hidden: int, inner: int) -> layers.Mlp:
    return layers.Mlp(randn(hidden, scale=0.1), ops.Dense(randn(2 * inner, hidden, scale=hidden ** -0.5)),
                      ops.Dense(randn(hidden, inner, scale=inner ** -0.5)))


def _linear_weights(d: layers.LinearDims, hidden: int, inner: int) -> layers.LinearAttn:
    rows = 2 * d.key_dim + 2 * d.value_dim + 2 * d.v_heads
    return layers.LinearAttn(randn(hidden, scale=0.1), ops.Dense(randn(rows, hidden, scale=hidden ** -0.5)),
                             randn(2 * d.key_dim + d.value_dim, 4, scale=0.3), torch.randn(d.v_heads, device="cuda"),
                             randn(d.v_heads), 1 + randn(d.head_v, scale=0.1),
                             ops.Dense(randn(hidden, d.value_dim, scale=d.value_dim ** -0.5)), _mlp(hidden, inner))


def _graphed(piece) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        piece()  # compilation, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        piece()
    return graph


def _update_error(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / (want.float() - before.float()).norm()).item()


@pytest.mark.parametrize("chosen", [*EPILOGUES, "all"])
@torch.inference_mode()
def test_compiled_graphed_pieces_with_epilogues_equal_the_plain_ones(chosen, tokens=512, hidden=512, inner=1024):
    """pre_linear_into + post_linear_into, then post_full_into, compiled with static shapes over static buffers and
    captured as CUDA graphs, with the fused kernels and the chosen epilogues, against the plain ops run eagerly;
    replayed twice from the same state (the residual kernel updates the static hidden buffer in place)."""
    names = EPILOGUES if chosen == "all" else (chosen,)
    d = _dims()
    w = _linear_weights(d, hidden, inner)
    fw = layers.FullAttn(randn(hidden), ops.Dense(randn(2 * 2 * 128 + 2 * 128, hidden)), None, None, randn(128),
                         randn(128), ops.Dense(randn(hidden, 256, scale=256 ** -0.5)), _mlp(hidden, inner))
    fd = layers.FullDims(2, 1, 128, 128 ** -0.5, EPS)
    plain = ops.Ops()
    fast = epilogues.epilogue_ops(fused.fused_ops(ops.Ops()), torch.device("cuda"),
                                  **{name: True for name in names})
    seqpos = torch.cat([torch.arange(n) for n in (200, 312)]).cuda()
    h, o, mixed, gate = randn(tokens, hidden), randn(tokens, 4, 128), randn(tokens, 2, 128), randn(tokens, 256)
    outs = [torch.zeros(tokens, 2, 128, device="cuda", dtype=bf16), torch.zeros(tokens, 2, 128, device="cuda",
                                                                                 dtype=bf16),
            torch.zeros(tokens, 4, 128, device="cuda", dtype=bf16), torch.zeros(tokens, 4, device="cuda"),
            torch.zeros(tokens, 4, device="cuda", dtype=bf16), torch.zeros(tokens, d.value_dim, device="cuda",
                                                                            dtype=bf16)]
    pre = compile_piece(pre_linear_into, inline=True, dynamic=False)
    post = compile_piece(post_linear_into, dynamic=False)
    post_f = compile_piece(post_full_into, dynamic=False)
    state = h.clone()

    def piece() -> None:
        pre(fast, d, w, state, seqpos, *outs)
        post(fast, d, w, state, o, outs[5])
        post_f(fast, fd, fw, state, mixed, gate)

    graph = _graphed(piece)
    expected = list(layers.pre_linear(plain, d, w, h, seqpos))
    after_linear = layers.post_linear(plain, d, w, h, o, expected[5])
    after = layers.post_full(plain, fd, fw, after_linear, mixed, gate)
    results = []
    for _ in range(2):
        state.copy_(h)
        graph.replay()
        torch.cuda.synchronize()
        results.append(state.clone())
    assert torch.equal(results[0], results[1])  # the graph reads the restored state, not the last result
    assert _update_error(results[0], after, h) < 0.03  # as tests/gpu/test_fused.py bounds compiled against eager
