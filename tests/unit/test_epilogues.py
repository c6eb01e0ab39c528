"""The opt-in epilogue kernels' setting, and the kernels themselves on the CPU through Triton's interpreter
(tests/unit/epilogues_interpreted.py, in a child process: skipped where Triton is not installed, as in CI)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worker.fast import ops

ROOT = Path(__file__).resolve().parents[2]
bf16 = torch.bfloat16


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(bf16)


def test_the_plain_ops_leave_the_hidden_state_alone():
    hidden, inputs, weights = randn(5, 8), randn(5, 4), ops.Dense(randn(8, 4))
    before = hidden.clone()
    assert ops.Ops().gate_up_swiglu(inputs, weights) is None  # the caller runs the GEMM, then SwiGLU
    assert torch.equal(ops.Ops().add_linear(hidden, inputs, weights), before + F.linear(inputs, weights.weight))
    assert torch.equal(hidden, before)


def test_the_engine_applies_the_setting_with_the_fused_kernels_only_and_says_so_once(loaded, caplog):
    """On the CPU the fused kernels do not run, so neither do these (the plain ops stay): one line at start says so
    (as it does with --no-fused-kernels on a GPU), where the flag was once dropped in silence."""
    from worker.config import Settings
    from worker.fast import FastEngine
    from worker.fast.mixers import TorchMixers

    model = loaded("repo")
    with caplog.at_level("INFO", logger="worker"):
        engine = FastEngine(model, Settings(epilogues="all", compile="none"), mixers=TorchMixers())
    assert engine.fwd.epilogues == frozenset() and engine.fwd.ops == ops.Ops()
    lines = [record.getMessage() for record in caplog.records if "--epilogues" in record.getMessage()]
    assert lines == ["--epilogues gated_norm,residual,swiglu not applied: they run with the fused kernels only "
                     "(--fused-kernels, a bf16 or fp16 model on CUDA)"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_the_kernels_in_triton_s_interpreter():
    """Triton reads TRITON_INTERPRET when it defines its functions: a child process, which sets it first."""
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/unit/epilogues_interpreted.py"], cwd=ROOT, capture_output=True, text=True,
                           timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
    assert " passed" in child.stdout and " failed" not in child.stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="needs triton, compiling")
def test_the_gemm_compiles_for_hopper_to_pipelined_wgmma_on_tma(tmp_path):
    """Compiled for sm_90 here (no GPU needed; Triton ships ptxas): every configuration uses TMA loads and wgmma,
    fits Hopper's shared memory, spills no register, and ptxas does not serialise its wgmma (what two accumulators
    in the flattened loop did)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from worker.fast import epilogues

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton has no ptxas")
    for name, config in epilogues.CONFIGS.items():
        m, n, k = config.block_m, config.block_n, config.block_k
        signature = {"x_desc": f"tensordesc<bf16[{m}, {k}]>", "w_desc": f"tensordesc<bf16[2, {n}, {k}]>",
                     "out_desc": f"tensordesc<bf16[{m}, {n}]>", "M": "i32", "I": "i32", "K": "i32",
                     **dict.fromkeys(("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "PROGRAMS"), "constexpr")}
        constants = dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=config.group_m, PROGRAMS=132)
        kernel = triton.compile(ASTSource(epilogues._gate_up_swiglu_kernel, signature, constants),
                                target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": config.warps, "num_stages": config.stages})
        ptx = kernel.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx, name
        assert kernel.metadata.shared <= 232448, (name, kernel.metadata.shared)  # 227 KiB per block on Hopper
        source = tmp_path / f"{name}.ptx"
        source.write_text(ptx)
        log = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(source), "-o", os.devnull], capture_output=True,
                             text=True, timeout=120)
        out = log.stdout + log.stderr
        assert log.returncode == 0 and "serialized" not in out and " 0 bytes spill stores" in out, (name, out)
