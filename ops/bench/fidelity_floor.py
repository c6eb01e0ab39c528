"""The fast engine's defaults (deterministic mode where its kernels run), and its twin without, against the bf16
floor on the fidelity set (issues 48, 49).

    python ops/bench/fidelity_floor.py --shape 2b --compile-cache DIR --out OUT/fidelity-floor   # one GPU
    python ops/bench/fidelity_floor.py --checkpoint DIR --requests 200 --out OUT                 # a checkpoint, GPU
    python ops/bench/fidelity_floor.py --shape tiny --requests 24 --out /tmp/floor               # CPU: the harness

The requests are ops/bench/fidelity_set.py's (every question type, prompts across the buckets 512 to 16384),
on random weights at a real shape (``--shape``, seeded: every process builds the same model) or a checkpoint
(``--checkpoint``: tests/gpu uses the tiny one). On the same GPU, in order: the reference engine in fp32 (the
same weights in fp32, transformers' torch delta rule, no TF32), the reference engine in bf16 (transformers'
own forward: its distance from fp32 is the floor), then the fast engine in each configuration of
``--configs``: ``defaults`` is ``Settings()`` as it is when this runs (only the compile cache set: deterministic
mode where its kernels run), ``nondeterministic`` the same with ``deterministic=False``; the others
(``CONFIGS``) say what the defaults' parts move. Packs are formed greedily in the set's order up to the
engine's budget, as the daemon's packer does under a backlog.

The references and the configurations run in child processes, at once on a GPU: the references in one,
deterministic configurations in another (deterministic mode's cuBLAS settings must precede the process's first
GPU matmul), the others in a third. Per configuration against fp32: the mean and worst of the per-question probability difference,
the flips, and each over the floor's (``FACTOR``). Writes ``report.json`` in ``--out`` and prints one
``SUMMARY`` line. With ``--shape tiny`` the fast engine runs on its CPU stand-ins, uncompiled: a check of the
harness, not a figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import fidelity_set  # noqa: E402

CONFIGS = {  # name -> Settings fields over Settings()'s defaults as they are at run time
    "defaults": {},
    "nondeterministic": {"deterministic": False},  # --no-deterministic
    # the defaults' kernels without Inductor and graphs (which deterministic mode needs)
    "eager": {"compile": "none", "cuda_graphs": False, "deterministic": False},
    "eager-no-epilogues": {"compile": "none", "cuda_graphs": False, "epilogues": "none", "deterministic": False},
    "no-epilogues": {"epilogues": "none"},
    "epilogues": {"epilogues": "residual,swiglu"},  # the kernels off by default: do they meet the floor yet?
}
GATED = ("defaults", "nondeterministic")  # the targets; the others explain them
SHOWN = ("epilogues", "compile", "cuda_graphs", "deterministic", "fused_kernels", "prune_last", "fp8",
         "buckets")  # the Settings fields that decide how answers are computed, in the report


def settings_for(name: str, args: argparse.Namespace):
    from worker.config import Settings

    fields = {**overrides(args), **CONFIGS[name]}
    if args.shape == "tiny" and not args.checkpoint:  # the CPU stand-ins run uncompiled
        fields["compile"] = "none"
    return dataclasses.replace(Settings(), compile_cache=args.compile_cache, **fields)


def overrides(args: argparse.Namespace) -> dict:
    """``--set`` fields, typed as Settings() has them (a figure measured with any is not the defaults')."""
    from worker.config import BOOLEANS, Settings

    defaults, out = Settings(), {}
    types = {f.name: f.type for f in dataclasses.fields(Settings)}
    for item in args.set:
        key, _, value = item.partition("=")
        boolean = types[key] in BOOLEANS  # a switch, set or unset (None) by default
        out[key] = value.lower() in ("1", "true", "yes") if boolean else type(getattr(defaults, key))(value)
    return out


def load_model(args: argparse.Namespace):
    """The model every child builds alike: random weights at ``--shape`` from ``--seed``, or ``--checkpoint``."""
    import torch

    from worker.model import checkpoint, tiny

    torch.manual_seed(args.seed)
    if args.checkpoint:
        model = checkpoint.load(args.checkpoint, device="cuda", dtype="bfloat16")
    elif args.shape == "tiny":  # bf16 on the CPU: a floor that is not zero
        path = tiny.write(tempfile.mkdtemp(), multimodal=False, max_positions=fidelity_set.LONGEST)
        model = checkpoint.load(path, device="cpu", dtype="bfloat16")
    else:
        from served import model_for

        model = model_for(args.shape)
    # A checkpoint reads what it reads (at most LONGEST); random weights read LONGEST.
    model.max_length = min(fidelity_set.LONGEST, model.max_length) if args.checkpoint else fidelity_set.LONGEST
    return model


def weights_digest(model) -> float:
    """A sum over the ends of every parameter: two children that built the same model agree on it exactly."""
    total = 0.0
    for parameter in model.model.parameters():
        flat = parameter.detach().reshape(-1)
        total += float(flat[:4096].double().sum()) + float(flat[-4096:].double().sum())
    return total


def the_set(model, args: argparse.Namespace) -> list:
    from worker.model.encoder import Encoder

    encoder = Encoder(model)
    # The CPU harness stops at 2048 tokens: its reference engine's attention would hold 16k x 16k scores.
    cap = args.longest or (16000 if model.device.type == "cuda" else 2048)
    longest = min(16000, model.max_length - 64, cap)
    return fidelity_set.prompts(encoder, fidelity_set.requests(encoder, args.requests, args.seed, longest))


def reference_scores(model, prompt_list: list, fp32: bool) -> list:
    """Head scores per prompt from the padded reference engine, in batches of like lengths (little padding)."""
    import contextlib

    from fidelity import fp32_copy
    from synthetic import padded_batches

    from worker.model.reference import ReferenceEngine

    order = sorted(range(len(prompt_list)), key=lambda i: prompt_list[i].length)
    scores: list = [None] * len(prompt_list)
    with (fp32_copy(model) if fp32 else contextlib.nullcontext(model)) as chosen:
        engine, at = ReferenceEngine(chosen), 0
        for batch in padded_batches([prompt_list[i] for i in order], size=32, max_padded=32768):
            for rows in engine.forward(batch):
                scores[order[at]] = rows
                at += 1
    return scores


def fast_scores(model, prompt_list: list, settings, cpu: bool) -> tuple[list, dict]:
    import torch
    from synthetic import packs

    from worker.fast import FastEngine

    extra = {}
    if cpu:
        from worker.fast.mixers import TorchMixers

        extra = dict(mixers=TorchMixers(), capture=(lambda piece: piece, lambda piece: piece()))
    began = time.perf_counter()
    engine = FastEngine(model, settings, **extra)
    engine.warmup()
    ready, engine_mode = time.perf_counter() - began, engine.deterministic  # as the engine decided
    scores = []
    for group in packs(prompt_list, engine.max_pack_tokens):
        scores += engine.launch(group).wait().scores
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return scores, {"ready_s": round(ready, 1), "seconds": round(time.perf_counter() - began, 1),
                    "deterministic": engine_mode}


def run_child(args: argparse.Namespace) -> int:
    """One child: the references (``--references``) and the fast engine in each of ``--child``'s configurations;
    saves every question's probabilities."""
    names = [name for name in args.child.split(",") if name]
    chosen = {name: settings_for(name, args) for name in names}
    if any(settings.deterministic is not False for settings in chosen.values()):  # asked for, or the default's
        from worker.fast import deterministic

        deterministic.prepare_process()  # before the process's first GPU matmul, the model's making included
    if args.compile_cache:  # before the references: fla's dispatch may load TileLang, which reads it once
        from worker.fast.warmup import use_compile_cache

        use_compile_cache(args.compile_cache)
    import torch

    model = load_model(args)
    prompt_list = the_set(model, args)
    saved: dict = {"answers": {}, "seconds": {}, "engine": {}, "errors": {}, "weights": weights_digest(model)}
    with torch.inference_mode():
        if args.references:
            for label, fp32 in (("fp32", True), ("bf16", False)):
                began = time.perf_counter()
                saved["answers"][label] = fidelity_set.answers(model, prompt_list,
                                                               reference_scores(model, prompt_list, fp32))
                saved["seconds"][label] = round(time.perf_counter() - began, 1)
                print(f"reference {label}: {saved['seconds'][label]} s", flush=True)
            saved["set"] = {"prompts": len(prompt_list), "tokens": sum(p.length for p in prompt_list),
                            "buckets": fidelity_set.buckets_reached(prompt_list)}
        for name, settings in chosen.items():  # one configuration failing leaves the others' figures
            try:
                cpu = model.device.type != "cuda"
                scores, saved["engine"][name] = fast_scores(model, prompt_list, settings, cpu)
                saved["answers"][name] = fidelity_set.answers(model, prompt_list, scores)
                print(f"{name}: {saved['engine'][name]}", flush=True)
            except Exception as error:  # noqa: BLE001 - reported as the configuration's failure
                traceback.print_exc()
                saved["errors"][name] = f"{type(error).__name__}: {error}"[:300]
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    torch.save(saved, args.save)
    return 0


def measure(args: argparse.Namespace, log=print) -> dict:
    """Runs the children and compares what they saved: at once on a GPU (each spends most of its time compiling
    on the host: one after the other, the gate's set took over 217 s at 72aab1e), one after the other on the CPU
    harness (two cores)."""
    names = [name for name in args.configs.split(",") if name]
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    settings = {name: settings_for(name, args) for name in names}
    # the references alone, then the configurations that share a process (deterministic mode's cuBLAS settings
    # are the process's)
    # (unset: the defaults', on where its kernels run, as on the Hopper cards this runs on)
    groups = [[], [n for n in names if settings[n].deterministic is False],
              [n for n in names if settings[n].deterministic is not False]]
    groups = [group for number, group in enumerate(groups) if group or number == 0]
    out_dir = Path(args.out)
    common = [arg for name in ("shape", "checkpoint", "requests", "seed", "compile_cache", "longest")
              for arg in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]
    common += [arg for item in args.set for arg in ("--set", item)]
    at_once = not (args.shape == "tiny" and not args.checkpoint)
    saved: dict = {"answers": {}, "seconds": {}, "engine": {}}
    failed = {}
    paths = [out_dir / f"answers-{number}.pt" for number in range(len(groups))]
    codes: dict[int, int | None] = {}
    children: dict[int, subprocess.Popen] = {}
    deadline = time.monotonic() + args.child_timeout
    try:
        for number, group in enumerate(groups):
            command = [sys.executable, __file__, *common, "--child", ",".join(group), "--save", str(paths[number])]
            command += ["--references"] if number == 0 else []
            log(f"child {number}: {' '.join(group) or 'references'}")
            children[number] = subprocess.Popen(command)
            if not at_once:
                codes[number] = _wait(children[number], deadline)
        for number, child in children.items():
            codes.setdefault(number, _wait(child, deadline))
    finally:
        for child in children.values():
            if child.poll() is None:
                child.kill()
    for number, group in enumerate(groups):
        code, path = codes.get(number), paths[number]
        if code != 0 or not path.exists():
            failed.update(dict.fromkeys(group or ["references"],
                                        "child timed out" if code is None else f"child exited {code}"))
            continue
        import torch

        got = torch.load(path)
        if saved.setdefault("weights", got["weights"]) != got["weights"]:  # compared with the references' model
            failed.update(dict.fromkeys(group, "this child's random weights differ from the references'"))
            continue
        for key in ("answers", "seconds", "engine"):
            saved[key].update(got[key])
        failed.update(got["errors"])
        saved.setdefault("set", got.get("set"))
    report = {"shape": args.shape, "model": (f"checkpoint {args.checkpoint}" if args.checkpoint else
                                            f"random weights at the {args.shape} shape, seed {args.seed}"),
              "requests": args.requests, "set": saved.get("set"), "factor": fidelity_set.FACTOR,
              "metric": "per question the largest probability difference over its options; mean, p99 and max "
                        "over the set; flips: questions whose most likely option differs",
              "overridden": overrides(args), "reference_seconds": saved["seconds"], "failed": failed,
              "configs": {}}
    answers = saved["answers"]
    if "fp32" in answers and "bf16" in answers:
        report["floor"] = fidelity_set.compare(answers["bf16"], answers["fp32"])
        for name in names:
            if name not in answers:
                continue
            figures = fidelity_set.compare(answers[name], answers["fp32"])
            report["configs"][name] = {
                "vs_fp32": figures, **fidelity_set.against_floor(figures, report["floor"]),
                "vs_bf16_reference": fidelity_set.compare(answers[name], answers["bf16"]),
                "settings": {key: getattr(settings[name], key) for key in SHOWN},
                "gated": name in GATED, **saved["engine"].get(name, {})}
    import torch

    report["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (cpu)"
    return report


def _wait(child: subprocess.Popen, deadline: float) -> int | None:
    """A child's exit status, or None when it ran past ``deadline`` (then it is killed)."""
    try:
        return child.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="2b", choices=("0.8b", "2b", "4b", "tiny"))
    parser.add_argument("--checkpoint", default="", help="a decision checkpoint on the GPU, not random weights")
    parser.add_argument("--requests", type=int, default=320, help="requests of the fidelity set")
    parser.add_argument("--seed", type=int, default=0, help="the set's and the random weights' seed")
    parser.add_argument("--longest", type=int, default=0, help="no prompt over this many tokens (0: 16000)")
    parser.add_argument("--configs", default="defaults,nondeterministic,eager,epilogues",
                        help=f"fast engine configurations, of {', '.join(CONFIGS)}")
    parser.add_argument("--compile-cache", default="", help="the engines' compile_cache (empty: the defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a Settings field for every configuration (the CPU harness: smaller buckets)")
    parser.add_argument("--child-timeout", type=float, default=900.0)
    parser.add_argument("--out", default="fidelity-floor")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--references", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return run_child(args)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a stage's limit: unwind, which kills the child too
    Path(args.out).mkdir(parents=True, exist_ok=True)
    report = measure(args)
    (Path(args.out) / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    summary = {"floor": report.get("floor"), "failed": report["failed"], "set": report["set"],
               **{name: {k: c[k] for k in ("mean_ratio", "p99_ratio", "mean_within", "p99_within")}
                  | {key: c["vs_fp32"][key] for key in ("mean", "p99", "max")}
                  for name, c in report["configs"].items()}}
    print("SUMMARY", json.dumps(summary), flush=True)
    return 0 if "floor" in report else 1


if __name__ == "__main__":
    sys.exit(main())
