"""The fast path's words (worker/fast_options.py): what --epilogues, --fp8-layers and --fp8-matrices accept, each
refused when the settings are made, before torch is imported or a model loaded."""

import subprocess
import sys
from pathlib import Path

import pytest

from worker.config import Settings, SettingsError
from worker.fast_options import (EPILOGUES, FP8_FAMILIES, chosen_epilogues, chosen_families, layer_choice)

ROOT = Path(__file__).resolve().parents[2]


def test_the_words_are_read_without_torch_or_the_fast_path():
    code = ("import sys, worker.config, worker.fast_options; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('worker.fast.')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


def test_epilogues_name_kernels_all_or_none():
    assert chosen_epilogues("") == chosen_epilogues(" none ") == frozenset()
    assert chosen_epilogues("all") == frozenset(EPILOGUES)
    assert chosen_epilogues("SwiGLU, residual") == {"swiglu", "residual"}
    for bad in ("swiglu,bogus", "all,swiglu", "norm"):
        with pytest.raises(ValueError, match="epilogues must be none, all, or some of"):
            chosen_epilogues(bad)


def test_fp8_matrices_name_families_or_all():
    assert chosen_families("all") == frozenset(FP8_FAMILIES)
    assert chosen_families("Attention, linear") == {"attention", "linear"}
    for bad in ("", "mlp,gates", "all,mlp"):
        with pytest.raises(ValueError, match="fp8_matrices must be all, or some of"):
            chosen_families(bad)


def test_fp8_layers_name_a_kind_or_indices_and_ranges():
    assert [layer_choice(spec) for spec in ("all", "Full", "linear", " late")] == ["all", "full", "linear", "late"]
    assert layer_choice("0-2, 7") == {0, 1, 2, 7}
    for bad in ("", "x", "3-", "5-3", "-1", "0-99999999999", "full,3"):
        with pytest.raises(ValueError, match="fp8_layers must be all, full, linear, late or layer indices"):
            layer_choice(bad)


def test_settings_refuse_each_bad_word_at_once_naming_the_flags():
    """They were once accepted: a typo failed after the checkpoint loaded on a GPU, and never on the CPU."""
    with pytest.raises(SettingsError) as refused:
        Settings(epilogues="bogus", fp8_layers="nonsense", fp8_matrices="gates")
    for flag in ("--epilogues (DQ_EPILOGUES)", "--fp8-layers (DQ_FP8_LAYERS)", "--fp8-matrices (DQ_FP8_MATRICES)"):
        assert flag in str(refused.value)
    fine = Settings(epilogues="none", fp8_layers="0-5,18", fp8_matrices="mlp")  # a model's size is checked on load
    assert fine.fp8_layers == "0-5,18"
