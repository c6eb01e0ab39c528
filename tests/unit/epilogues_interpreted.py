"""The opt-in epilogue kernels (worker/fast/epilogues.py) through Triton's interpreter, against their PyTorch forms.

Run by tests/unit/test_epilogues.py in a child process with TRITON_INTERPRET=1 (Triton reads it when its own
functions are defined, at import, so it cannot be switched on in a process that has imported Triton already).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/unit/test_epilogues.py"

from triton.language import bfloat16 as tl_bf16, float32 as tl_f32  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from worker.fast import epilogues as ep  # noqa: E402
from worker.fast import layers, ops  # noqa: E402
from worker.fast_options import EPILOGUES  # noqa: E402

bf16 = torch.bfloat16
EPS = 1e-6


@pytest.fixture(autouse=True)
def interpreter_fixes(monkeypatch):
    """Triton 3.6's interpreter against numpy 2.4 and bf16: a 1-element array's int() (numpy refuses it), bf16
    operands of tl.dot (held as uint16 bits), fp32 -> bf16 casts (truncated, where the GPU rounds to nearest even).
    Without these it computes other numbers than the GPU would, in the interpreter only."""
    patch_tensor, dot, cast = (interpreter._patch_lang_tensor, interpreter.InterpreterBuilder.create_dot,
                               interpreter.InterpreterBuilder.cast_impl)

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def as_fp32(handle):
        if handle.dtype != tl_bf16:
            return handle
        return interpreter.TensorHandle((handle.data.astype(np.uint32) << 16).view(np.float32), tl_f32)

    def create_dot(self, a, b, d, *args):
        return dot(self, as_fp32(a), as_fp32(b), d, *args)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl_f32 and dst_type.scalar == tl_bf16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(bf16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl_bf16)
        return cast(self, src, dst_type)

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched_tensor)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Configurations small enough for the interpreter: 16-row tiles, in the same roles as the GPU's."""
    monkeypatch.setitem(ep.CONFIGS, "tiny", ep.GemmConfig(16, 16, 16, 2, 2, 4))
    monkeypatch.setitem(ep.CONFIGS, "tiny-wide", ep.GemmConfig(32, 16, 16, 1, 2, 4))
    monkeypatch.setattr(ep, "BY_TOKENS", ((32, "tiny-wide"), (0, "tiny")))
    monkeypatch.setattr(ep, "INVARIANT", "tiny")


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(bf16)


def steps_apart(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference in bf16 steps (units in the last place) of ``want``, values under a 64th of the
    largest counted at that size (a sum that cancels keeps its addends' rounding)."""
    want = want.float()
    size = want.abs().clamp_min(want.abs().max().item() / 64 + 2.0 ** -100)
    return ((got.float() - want).abs() / 2.0 ** (torch.floor(torch.log2(size)) - 7)).max().item()


def update_error(got: torch.Tensor, want: torch.Tensor, before: torch.Tensor) -> float:
    """A layer's residual update against the plain ops' (through GEMMs whose inputs moved by bf16 roundings), as
    tests/gpu/test_fused.py measures it."""
    return ((got.float() - want.float()).norm() / (want.float() - before.float()).norm()).item()


@pytest.mark.parametrize("tokens", [1, 40])
def test_gate_up_swiglu_rounds_as_the_compiled_path(tokens, inner=32, k=40):
    """K = 40: the last 16-wide block is read past the end (zeros); 40 rows leave a partial tile, stored clipped."""
    x, weight = randn(tokens, k), randn(2 * inner, k, scale=0.2)
    got = ep.gate_up_swiglu(x, weight, False)
    gate, up = (x.float() @ weight.float().T).to(bf16).float().chunk(2, dim=-1)  # the GEMM's bf16 outputs
    assert got.shape == (tokens, inner) and got.dtype == bf16
    assert steps_apart(got, (gate * torch.sigmoid(gate) * up).to(bf16)) <= 1
    assert steps_apart(got, ops.swiglu(ops.linear(x, ops.Dense(weight)))) <= 2  # eager rounds silu(gate) too


def test_gate_up_swiglu_rows_do_not_depend_on_the_pack(inner=32, k=48):
    """Deterministic mode's configuration: a row's bits alone as in a pack, wherever it lies (the GPU test checks
    the GPU's sums; here the tiling and the clipped tiles)."""
    rows, weight = randn(48, k), randn(2 * inner, k, scale=0.2)
    reference = ep.gate_up_swiglu(rows, weight, True)
    for size in (1, 7, 17, 33):
        order = torch.arange(size) + (48 - size) // 2 + 1
        assert torch.equal(ep.gate_up_swiglu(rows[order], weight, True), reference[order]), size


def test_configurations_by_token_count():
    assert ep.config_for(40, False) == ep.CONFIGS["tiny-wide"] and ep.config_for(8, False) == ep.CONFIGS["tiny"]
    assert {ep.config_for(n, True) for n in (1, 40, 16384)} == {ep.CONFIGS["tiny"]}
    shipped = [config for name, config in ep.CONFIGS.items() if not name.startswith("tiny")]
    assert len({config.block_k for config in shipped}) == 1  # one order of sums over K whichever runs


def test_gate_up_swiglu_falls_back_where_the_inner_size_does_not_tile(k=32):
    x, weight = randn(20, k), randn(2 * 24, k, scale=0.2)  # 24 columns: not a multiple of the 16-wide blocks
    gate, up = F.linear(x, weight).float().chunk(2, dim=-1)
    assert torch.equal(ep.gate_up_swiglu(x, weight, False), (F.silu(gate) * up).to(bf16))


def test_gated_rms_norm_equals_the_pytorch_form(tokens=5, heads=4, dim=16):
    o = randn(tokens, heads, dim)
    z = randn(tokens, heads * dim + 6)[:, 3: 3 + heads * dim]  # strided: a view of the in-projection
    weight = (1 + 0.1 * torch.randn(dim)).to(bf16)
    got = ep.gated_rms_norm(o, z, weight, EPS)
    assert got.shape == (tokens, heads * dim) and steps_apart(got, ops.gated_norm(o, z, weight, EPS)) <= 1


def test_add_linear_updates_the_hidden_state_in_place_rounding_once():
    hidden, x, weight = randn(6, 32), randn(6, 16), randn(32, 16)
    exact = hidden.float() + x.float() @ weight.float().T
    updated = hidden.clone()
    ep.add_linear_(updated, x, weight)
    assert steps_apart(updated, exact.to(bf16)) <= 1 and not torch.equal(updated, hidden)


def _linear_weights(hidden: int = 64, inner: int = 32) -> tuple[layers.LinearDims, layers.LinearAttn]:
    d = layers.LinearDims(32, 64, 2, 4, 16, 16, EPS)
    mlp = layers.Mlp(randn(hidden, scale=0.1), ops.Dense(randn(2 * inner, hidden, scale=0.1)),
                     ops.Dense(randn(hidden, inner, scale=0.1)))
    weights = layers.LinearAttn(randn(hidden, scale=0.1), ops.Dense(randn(10, hidden)), randn(3, 4), torch.randn(4),
                                randn(4), 1 + randn(16, scale=0.1), ops.Dense(randn(hidden, 64, scale=0.1)), mlp)
    return d, weights


@pytest.mark.parametrize("chosen", [*EPILOGUES, "all"])
def test_layers_with_epilogues_equal_the_plain_ones(chosen):
    """post_linear and post_full, eager, each kernel alone and all together, against the plain ops."""
    names = EPILOGUES if chosen == "all" else (chosen,)
    fast = ep.epilogue_ops(ops.Ops(), torch.device("cpu"), **{name: True for name in names})
    d, w = _linear_weights()
    h, o, z = randn(24, 64), randn(24, 4, 16), randn(24, 64)
    want = layers.post_linear(ops.Ops(), d, w, h, o, z)
    state = h.clone()
    got = layers.post_linear(fast, d, w, state, o, z)
    assert (got is state) == ("residual" in names)  # the residual kernels update the hidden state in place
    assert update_error(got, want, h) < 0.02
    fd = layers.FullDims(2, 1, 32, 0.1, EPS)
    fw = layers.FullAttn(randn(64), ops.Dense(randn(192, 64)), None, None, randn(32), randn(32),
                         ops.Dense(randn(64, 64, scale=0.1)), w.mlp)
    mixed, gate = randn(24, 2, 32), randn(24, 64)
    assert update_error(layers.post_full(fast, fd, fw, h.clone(), mixed, gate),
                        layers.post_full(ops.Ops(), fd, fw, h, mixed, gate), h) < 0.02


def test_fp8_weights_keep_their_path():
    """FP8 weights (and an FP8 down projection, which takes SwiGLU's output quantised) go to the base functions."""
    _, w = _linear_weights()
    fp8 = ops.Fp8(torch.zeros(64, 32, dtype=torch.float8_e4m3fn), torch.ones(1, 64))
    base = dataclasses.replace(ops.Ops(), gate_up_swiglu=lambda *args: "base", add_linear=lambda *args: "base",
                               gated_norm=lambda *args: "base")
    fast = ep.epilogue_ops(base, torch.device("cpu"), swiglu=True, residual=True, gated_norm=True)
    assert fast.gate_up_swiglu(randn(3, 64), w.mlp.gate_up, fp8) == "base"
    assert fast.gate_up_swiglu(randn(3, 64), w.mlp.gate_up, w.mlp.down).shape == (3, 32)
    assert fast.add_linear(randn(3, 64), randn(3, 32), fp8) == "base"
    assert fast.gated_norm(randn(3, 4, 16), randn(3, 64), randn(16), EPS, fp8) == "base"


@torch.inference_mode()
def test_a_compiled_piece_calls_the_kernels_and_updates_hidden_in_place():
    """post_linear_into compiled with static shapes, every kernel on: Inductor calls the custom ops (the residual
    one on the piece's hidden buffer itself) and the result matches the plain ops run eagerly."""
    from worker.fast.forward import compile_piece
    from worker.fast.graphs import post_linear_into

    fast = ep.epilogue_ops(ops.Ops(), torch.device("cpu"), swiglu=True, residual=True, gated_norm=True)
    d, w = _linear_weights()
    h, o, z = randn(24, 64), randn(24, 4, 16), randn(24, 64)
    state = h.clone()
    compile_piece(post_linear_into, dynamic=False)(fast, d, w, state, o, z)
    assert update_error(state, layers.post_linear(ops.Ops(), d, w, h, o, z), h) < 0.02
