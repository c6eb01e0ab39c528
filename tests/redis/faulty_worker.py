"""A real worker process whose real engine is wrapped by a fault injector: for the fault tests only.

    python tests/redis/faulty_worker.py serve <the flags of python -m worker serve>

Same daemon, same model, same Redis code as ``python -m worker serve``; only the engine's ``launch`` misbehaves,
as the environment says:

- ``DQ_FAULT_RAISE=MARKER``: a pack holding a prompt whose text contains MARKER fails when its scores are awaited
  (where a real GPU error surfaces), whatever else rides in the pack. A poison input.
- ``DQ_FAULT_SLOW_S=SECONDS``: every pack sleeps this long before it runs (a pack slower than the reclaim idle
  time; also a window for killing a worker mid-pack).

Each fault is logged (``fault: ...``) so that a test can see that it happened and wait for it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from worker.model.engine import Pending  # noqa: E402

log = logging.getLogger("worker.fault")


class FaultyEngine:
    """Wraps an Engine; passes everything through except the faults it was asked for."""

    def __init__(self, inner, tokenizer, marker: str = "", slow_s: float = 0.0) -> None:
        self.inner = inner
        self.tokenizer = tokenizer
        self.marker = marker
        self.slow_s = slow_s
        self.name = inner.name
        self.deterministic = inner.deterministic
        self.slow_packs = self.poisoned_packs = 0  # how many happened (in-process tests wait on these)
        self.poisoned_sizes: list[int] = []  # the prompts of each poisoned pack
        self.prompts = 0  # prompts launched: the count of computed prompts that cancel tests check
        self.texts: list[str] | None = None  # a list: every launched prompt's text is kept there (in-process tests)
        self.gate: threading.Event | None = None  # an Event: each pack waits for it before it runs (in-process tests)

    @property
    def max_pack_tokens(self) -> int:
        return self.inner.max_pack_tokens

    @property
    def pack_sizes(self) -> tuple[int, ...]:
        return self.inner.pack_sizes

    def warmup(self) -> None:
        self.inner.warmup()

    def launch(self, prompts):
        self.prompts += len(prompts)
        if self.texts is not None:
            self.texts += [self.tokenizer.decode(prompt.input_ids) for prompt in prompts]
        if self.gate is not None:
            self.gate.wait()
        if self.slow_s:
            self.slow_packs += 1
            log.info("fault: slow pack of %d prompts started (%.1f s)", len(prompts), self.slow_s)
            time.sleep(self.slow_s)
        poisoned = self.marker and any(self.marker in self.tokenizer.decode(c.input_ids) for c in prompts)
        pending = self.inner.launch(prompts)
        if not poisoned:
            return pending

        self.poisoned_packs += 1
        self.poisoned_sizes.append(len(prompts))

        def fail():
            log.warning("fault: pack of %d prompts raises (poison)", len(prompts))
            raise RuntimeError(f"injected fault: a prompt contains {self.marker}")

        return Pending(fail)


PLANNER_KILLER = b"KILLS-ITS-PLANNER"


def plan_or_die(job):
    """Planning in a planner process, except that a body holding PLANNER_KILLER ends the process at once (an image
    decoder that crashes on one input): put in place of worker.plan.planner._plan_in_process."""
    from worker.plan import planner

    if job.raw is not None and PLANNER_KILLER in job.raw:
        os._exit(9)
    return planner._plan_in_process(job)  # in the planner process: the unpatched one


def main() -> int:
    from worker.__main__ import main as worker_main
    from worker import daemon as daemons
    from worker.launch import launcher

    real_create = daemons.create_engine

    def faulty_create(model, settings):
        return FaultyEngine(real_create(model, settings), model.tokenizer, os.environ.get("DQ_FAULT_RAISE", ""),
                            float(os.environ.get("DQ_FAULT_SLOW_S", "0")))

    # The daemon's own construction runs unchanged; the engine it creates comes wrapped.
    daemons.create_engine = faulty_create
    launcher.ENTRY = [__file__]  # serve --gpus here: the launcher's workers are faulty workers too
    return worker_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
