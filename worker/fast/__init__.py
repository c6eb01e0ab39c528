"""The fast engine: packs of prompts through one padding-free forward (see engine.py). It plugs in through the
engine contract (worker/model/engine.py); on a machine without CUDA or fla it loads, and says what is missing
when constructed."""

from .engine import FastEngine
from .errors import FastPathUnavailable

__all__ = ["FastEngine", "FastPathUnavailable"]
