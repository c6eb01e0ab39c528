"""FlashQLA's kernel variants compiled in child processes while the engine compiles and captures its graphs.

On an empty cache TileLang compiled the delta rule's variants one after the other in the warm-up packs, after
the capture: about 110 s of a 212 s cold start on an H200 (each main kernel 19-23 s, the split variant's four
kernels 47 s). The compiling is CPU work (TileLang's lowering, nvcc) and independent per variant, and
TileLang's disk cache is shared between processes (each entry staged and renamed into place), so one child per
variant compiles it beside the capture; the warm-up packs then find the kernels on disk. A child that fails or
is late costs nothing but the time saved: the warm-up packs compile what they do not find, as before.

Run as a script (``python prebuild.py JSON``), the child imports torch, FlashQLA and worker/fast/qla.py only
(by path: the worker package would import transformers) and runs one pack of that variant on random inputs of
the dtypes and head counts the engine's buffers hold (worker/fast/graphs.py's Workspace).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass
class Prebuild:
    """The children compiling the variants; ``join`` waits for them (at most ``timeout`` s) and logs each."""

    children: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    began: float = field(default_factory=time.perf_counter)

    def join(self, log: Any, timeout: float = 300.0) -> None:
        deadline = time.perf_counter() + timeout
        for what, child in self.children:
            try:
                out, _ = child.communicate(timeout=max(1.0, deadline - time.perf_counter()))
            except subprocess.TimeoutExpired:
                child.kill()
                out, _ = child.communicate()
            tail = (out or "").strip().splitlines()[-1:] or ["(no output)"]
            if child.returncode == 0:
                log.info("warm-up: %s compiled beside the capture: %s", what, tail[0])
            else:  # the warm-up pack compiles it instead
                log.warning("warm-up: compiling %s beside the capture failed (exit %s): %s", what,
                            child.returncode, tail[0])
        log.info("warm-up: delta-rule variants compiled beside the capture, %.1fs after they started",
                 time.perf_counter() - self.began)


def start(variants: dict[Any, Sequence[int]], k_heads: int, v_heads: int, head_k: int, head_v: int,
          dtype: str = "bfloat16") -> Prebuild:
    """One child per variant, each running one pack of its prompt lengths."""
    prebuild = Prebuild()
    for variant, lengths in variants.items():
        job = {"lengths": list(lengths), "k_heads": k_heads, "v_heads": v_heads, "head_k": head_k,
               "head_v": head_v, "dtype": dtype, "split": getattr(variant, "split", True) is not False}
        child = subprocess.Popen([sys.executable, os.path.join(HERE, "prebuild.py"), json.dumps(job)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        prebuild.children.append((str(variant), child))
    return prebuild


def _run(job: dict) -> str:
    import importlib.util
    from types import SimpleNamespace

    import torch
    import torch.nn.functional as F

    spec = importlib.util.spec_from_file_location("_dq_qla", os.path.join(HERE, "qla.py"))
    assert spec is not None and spec.loader is not None
    qla = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qla)
    began = time.perf_counter()
    lengths, dtype = job["lengths"], getattr(torch, job["dtype"])
    tokens = sum(lengths)
    cu = torch.tensor([0, *__import__("itertools").accumulate(lengths)])
    bounds = SimpleNamespace(cu_host=cu, cu_long=cu.cuda())
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    with torch.inference_mode():
        q = F.normalize(randn(tokens, job["k_heads"], job["head_k"]), dim=-1).to(dtype)
        k = F.normalize(randn(tokens, job["k_heads"], job["head_k"]), dim=-1).to(dtype)
        v = randn(tokens, job["v_heads"], job["head_v"]).to(dtype)
        g = F.logsigmoid(randn(tokens, job["v_heads"]) + 3)  # fp32, as the engine's buffer
        beta = torch.sigmoid(randn(tokens, job["v_heads"])).to(dtype)
        flash = qla.FlashQLA(split=job.get("split", True))  # an unsplit variant stays so (deterministic mode)
        variant = flash.variant(lengths, job["v_heads"])
        out = flash(q, k, v, g, beta, bounds)
        torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    return f"{variant}, {len(lengths)} prompts, {tokens} tokens: {time.perf_counter() - began:.1f}s"


if __name__ == "__main__":
    print(_run(json.loads(sys.argv[1])), flush=True)
