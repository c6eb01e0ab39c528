"""The fast path's choices as words: what ``--epilogues``, ``--fp8-layers``, ``--fp8-matrices`` and
``--compile`` accept, parsed here alone. Torch-free: worker/config.py refuses a bad value with these when the
settings are made, before the model loads; the fast engine (worker/fast) applies what they return.
"""

from __future__ import annotations

# torch.compile of nothing, of each sub-module, of each layer's pieces
COMPILE_MODES = ("none", "sub", "layer")
EPILOGUES = ("swiglu", "residual", "gated_norm")  # the kernels of worker/fast/epilogues.py
# Off: residual and swiglu bought 3.9% end to end on an H100 but moved answers to 1.7 times the bf16 floor
# (issue 48; an epilogue that cannot meet the floor ships off). The gate measures them ("epilogues").
DEFAULT_EPILOGUES = "none"
# SwiGLU MLPs; full-attention projections; linear-attention ones
FP8_FAMILIES = ("mlp", "attention", "linear")
FP8_LAYER_NAMES = ("all", "full", "linear", "late")  # late: the second half of the layers
MAX_LAYERS = 10_000  # a layer index past this is a typo: refused before a range that large is built

# What each setting accepts, as its errors say it.
EPILOGUES_ARE = f"none, all, or some of {', '.join(EPILOGUES)} comma-separated"
FP8_LAYERS_ARE = "all, full, linear, late or layer indices like 0-5,18"
FP8_MATRICES_ARE = f"all, or some of {', '.join(FP8_FAMILIES)} comma-separated"


def _names(spec: str) -> set[str]:
    return {part.strip() for part in spec.lower().split(",") if part.strip()}


def chosen_epilogues(spec: str) -> frozenset[str]:
    """The kernels an ``epilogues`` setting names: none (or empty), "all", or any of ``EPILOGUES``."""
    names = _names(spec)
    if names == {"none"}:
        return frozenset()
    if names == {"all"}:
        return frozenset(EPILOGUES)
    if not names <= set(EPILOGUES):
        raise ValueError(f"epilogues must be {EPILOGUES_ARE}; got {spec!r}")
    return frozenset(names)


def chosen_families(spec: str) -> frozenset[str]:
    """The families of matrices an ``fp8_matrices`` setting names: "all", or any of ``FP8_FAMILIES``."""
    names = _names(spec)
    if names == {"all"}:
        return frozenset(FP8_FAMILIES)
    if not names or not names <= set(FP8_FAMILIES):
        raise ValueError(f"fp8_matrices must be {FP8_MATRICES_ARE}; got {spec!r}")
    return frozenset(names)


def layer_choice(spec: str) -> str | frozenset[int]:
    """What an ``fp8_layers`` setting names: one of ``FP8_LAYER_NAMES``, or the layer indices its
    comma-separated indices and ranges list ("0-5,18"). Which layers of a model those are, and whether it has
    them, is worker/fast/fp8.py's ``chosen_layers``."""
    spec = spec.strip().lower()
    if spec in FP8_LAYER_NAMES:
        return spec
    chosen: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        first, dash, last = part.partition("-")
        if not (first.isdigit() and (last.isdigit() or not dash)
                and MAX_LAYERS > int(last or first) >= int(first)):
            raise ValueError(f"fp8_layers must be {FP8_LAYERS_ARE}; got {spec!r}")
        chosen.update(range(int(first), int(last or first) + 1))
    if not chosen:
        raise ValueError(f"fp8_layers must be {FP8_LAYERS_ARE}; got {spec!r}")
    return frozenset(chosen)


# The settings checked here when they are parsed: setting -> (its parse, what it accepts).
CHECKED = {"epilogues": (chosen_epilogues, EPILOGUES_ARE), "fp8_layers": (layer_choice, FP8_LAYERS_ARE),
           "fp8_matrices": (chosen_families, FP8_MATRICES_ARE)}
