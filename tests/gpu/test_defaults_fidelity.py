"""The fast engine's defaults stay at the bf16 floor: on the fidelity set (ops/bench/fidelity_set.py: every
question type, prompts in every bucket from 512 to 16384 tokens), ``Settings()`` as it is when the test runs
moves answers from an fp32 reference at most 1.1x as far as transformers' own bf16 forward does, in mean and
in p99 over the questions (ops/bench/fidelity_set.py says why not the max). The defaults run deterministic mode
where its kernels run (Hopper, Blackwell): ops/bench/fidelity_floor.py sets cuBLAS up for it in a process of its
own, before the first GPU matmul.

Model: the tiny checkpoint's "small" size (the heads the GPU kernels take), text only, reading 16384 tokens;
the gate (ops/bench/gate.sh) measures the same on random weights at the 2B shape. DQ_GPU_REPORT=path appends
the figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("fla", reason="the fast engine needs flash-linear-attention")

BENCH = Path(__file__).resolve().parents[2] / "ops" / "bench"
sys.path.insert(0, str(BENCH))

import fidelity_set  # noqa: E402
from fidelity_floor import SHOWN  # noqa: E402
from support import report  # noqa: E402
from worker.config import Settings  # noqa: E402
from worker.fast.qla import FlashQLA  # noqa: E402
from worker.model import tiny  # noqa: E402


def test_the_defaults_answer_the_fidelity_set_within_the_bf16_floor(tmp_path):
    checkpoint = tiny.write(tmp_path / "small", size="small", multimodal=False,
                            max_positions=fidelity_set.LONGEST)
    out = tmp_path / "floor"
    subprocess.run([sys.executable, str(BENCH / "fidelity_floor.py"), "--checkpoint", str(checkpoint),
                    "--configs", "defaults", "--out", str(out)], check=True, timeout=900)
    result = json.loads((out / "report.json").read_text())
    defaults = result["configs"]["defaults"]
    report(test="defaults-fidelity", floor=result["floor"], defaults=defaults["vs_fp32"],
           settings=defaults["settings"], mean_ratio=defaults["mean_ratio"], p99_ratio=defaults["p99_ratio"],
           set=result["set"])
    assert result["overridden"] == {}
    assert defaults["settings"] == {key: getattr(Settings(), key) for key in SHOWN}
    # on by default where FlashQLA's kernels run (the small size's heads are 128 wide)
    assert defaults["deterministic"] is (FlashQLA.missing() is None), defaults
    assert all(count > 0 for count in result["set"]["buckets"].values()), result["set"]
    assert result["floor"]["questions"] > 500 and result["floor"]["mean"] > 0
    figures = {key: defaults[key] for key in ("mean_ratio", "p99_ratio")}
    assert defaults["mean_within"] and defaults["p99_within"], (
        f"the defaults ({defaults['settings']}) move answers past {fidelity_set.FACTOR}x the bf16 floor: {figures}, "
        f"floor {result['floor']}, defaults {defaults['vs_fp32']}")

