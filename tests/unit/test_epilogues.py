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
from worker.fast.forward import EPILOGUES, chosen_epilogues

ROOT = Path(__file__).resolve().parents[2]
bf16 = torch.bfloat16


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(bf16)


def test_the_setting_names_kernels_or_all():
    assert chosen_epilogues("") == frozenset() and chosen_epilogues(" ") == frozenset()
    assert chosen_epilogues("all") == frozenset(EPILOGUES)
    assert chosen_epilogues("SwiGLU, residual") == {"swiglu", "residual"}
    for bad in ("swiglu,bogus", "all,swiglu", "norm"):
        with pytest.raises(ValueError, match="epilogues"):
            chosen_epilogues(bad)


def test_the_plain_ops_leave_the_hidden_state_alone():
    hidden, inputs, weights = randn(5, 8), randn(5, 4), ops.Dense(randn(8, 4))
    before = hidden.clone()
    assert ops.Ops().gate_up_swiglu(inputs, weights) is None  # the caller runs the GEMM, then SwiGLU
    assert torch.equal(ops.Ops().add_linear(hidden, inputs, weights), before + F.linear(inputs, weights.weight))
    assert torch.equal(hidden, before)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_the_kernels_in_triton_s_interpreter():
    """Triton reads TRITON_INTERPRET when it defines its functions: a child process, which sets it first."""
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/unit/epilogues_interpreted.py"], cwd=ROOT, capture_output=True, text=True,
                           timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
    assert " passed" in child.stdout and " failed" not in child.stdout
