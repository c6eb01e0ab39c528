"""Deterministic mode on the GPU: a held-out set of prompts (standard, long-tail up to one over the largest bucket,
images, a request split over several prompts) computed alone and first, last and among random traffic in every
bucket, in worker-like processes started apart (tests/gpu/bitwise_run.py): in deterministic mode every score is
bitwise the same (``torch.equal``) in every place, bucket and process; the default mode's spread is reported.

The processes run at once, each with a compile cache of its own (none loads another's kernels or tuning): five of
them, a few minutes on an H200. Deterministic mode compiles fewer graphs than the default (one per piece for every
bucket, not one per bucket), and no process compiles anything after its warm-up. DQ_GPU_REPORT=path appends the
figures.

The same bits on every card: the deterministic process's scores of the held-out set alone are recorded as digests
in tests/gpu/digests.json, each record with the card and software that produced it; on any card, the software
of a record must give its digests (DQ_RECORD_DIGESTS=path writes this card's record there, to commit).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("flash_qla", reason="deterministic mode runs the delta rule on FlashQLA")

from support import report  # noqa: E402
from worker.model import tiny  # noqa: E402

RUN = Path(__file__).with_name("bitwise_run.py")
DIGESTS = Path(__file__).with_name("digests.json")
# what decides the bits besides the card: a record holds for these versions only
SOFTWARE = ("torch", "triton", "flash-qla", "tilelang", "transformers", "nvidia-cublas-cu12", "nvidia-cublas")
PROCESSES = {  # name -> flags
    "deterministic": ["--deterministic", "--seed", "1"],
    "deterministic, second process": ["--deterministic", "--seed", "2"],
    "deterministic fp8": ["--deterministic", "--fp8", "--seed", "3"],
    "deterministic epilogues": ["--deterministic", "--epilogues", "all", "--seed", "4"],
    "default": ["--seed", "1"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("determinism")
    checkpoint = tiny.write(root / "small", size="small")
    started = {name: subprocess.Popen([sys.executable, str(RUN), str(checkpoint), str(root / f"{number}.pt"), *flags,
                                       "--cache", str(root / f"cache-{number}")],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for number, (name, flags) in enumerate(PROCESSES.items())}
    out = {"checkpoint": checkpoint}
    for number, (name, child) in enumerate(started.items()):
        log, _ = child.communicate(timeout=900)
        print(f"--- {name}: exit {child.returncode}\n" + "\n".join(log.splitlines()[-8:]))
        out[name] = torch.load(root / f"{number}.pt") if child.returncode == 0 else log
    return out


def apart(results: dict, baseline: dict) -> tuple[list[str], float, int]:
    """Every score against the baseline's prompt alone: the places that differ, the largest difference, and the
    number compared."""
    differ, worst, compared = [], 0.0, 0
    for key, got in results.items():
        for label, scores in got.items():
            compared += 1
            gap = (scores - baseline[key]["alone"]).abs().max().item()
            if not torch.equal(scores, baseline[key]["alone"]):
                differ.append(f"{key} {label}: {gap:g}")
            worst = max(worst, gap)
    return differ, worst, compared


@pytest.mark.parametrize("name", ["deterministic", "deterministic, second process"])
def test_in_deterministic_mode_every_score_has_the_same_bits_in_every_pack_bucket_place_and_process(runs, name):
    first = runs["deterministic"]
    assert isinstance(runs[name], dict), f"the {name} process failed:\n{runs[name]}"
    assert runs[name]["recompiled"] == 0 and runs[name]["graphs"] < runs["default"]["graphs"]
    differ, worst, compared = apart(runs[name]["scores"], first["scores"])
    report(test="determinism", mode=name, vs="deterministic process, prompt alone", compared=compared,
           unequal=len(differ), max_score_diff=worst)
    assert not differ, differ[:20]
    assert compared > 90  # 14 held-out prompts, alone and in up to 9 packs each


def test_without_the_mode_the_spread_is_reported_and_stays_within_bf16_rounding(runs):
    default = runs["default"]
    assert isinstance(default, dict), f"the default process failed:\n{default}"
    assert default["recompiled"] == 0
    differ, worst, compared = apart(default["scores"], default["scores"])
    against, worst_against, _ = apart(default["scores"], runs["deterministic"]["scores"])
    report(test="determinism", mode="default", vs="default process, prompt alone", compared=compared,
           unequal=len(differ), max_score_diff=worst, vs_deterministic_unequal=len(against),
           vs_deterministic_max_score_diff=worst_against)
    assert worst < 0.5 and worst_against < 0.5  # logits: 0.18 apart on an H100; a wiring fault moves them by more


def test_fp8_in_deterministic_mode_keeps_the_same_bits_too(runs):
    fp8 = runs["deterministic fp8"]
    assert isinstance(fp8, dict), f"the deterministic FP8 process failed:\n{fp8}"
    differ, worst, compared = apart(fp8["scores"], fp8["scores"])
    report(test="determinism", mode="deterministic fp8", vs="same process, prompt alone", compared=compared,
           unequal=len(differ), max_score_diff=worst)
    assert not differ, differ[:20]


def test_the_epilogue_kernels_in_deterministic_mode_keep_the_same_bits_too(runs):
    """--epilogues all (worker/fast/epilogues.py): the same bits alone and in every pack, and within bf16's spread
    of the deterministic process without them (other kernels, other roundings)."""
    fused = runs["deterministic epilogues"]
    assert isinstance(fused, dict), f"the deterministic epilogues process failed:\n{fused}"
    differ, worst, compared = apart(fused["scores"], fused["scores"])
    against, worst_against, _ = apart(fused["scores"], runs["deterministic"]["scores"])
    report(test="determinism", mode="deterministic epilogues", vs="same process, prompt alone", compared=compared,
           unequal=len(differ), max_score_diff=worst, vs_deterministic_max_score_diff=worst_against)
    assert not differ, differ[:20]
    assert worst_against < 0.5


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def this_card() -> dict:
    """The card and the software a record is made with."""
    properties = torch.cuda.get_device_properties(0)
    software = {}
    for name in SOFTWARE:
        try:
            software[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    software["cuda"] = torch.version.cuda
    return {"card": properties.name, "multiprocessors": properties.multi_processor_count,
            "capability": f"{properties.major}.{properties.minor}", "software": software}


def test_deterministic_mode_gives_the_recorded_bits_on_every_card(runs):
    """The held-out set's scores alone, as digests, against every record of this software in
    tests/gpu/digests.json, whichever card made it. cuBLAS promises the same bits only on cards of one
    architecture and one multiprocessor count (its documentation, "Results reproducibility"): a record from
    another count that differs says so. No record of this software: the digests are reported, and written to
    DQ_RECORD_DIGESTS where set."""
    first = runs["deterministic"]
    assert isinstance(first, dict), f"the deterministic process failed:\n{first}"
    weights = digest(b"".join(path.read_bytes() for path in sorted(Path(runs["checkpoint"]).glob("*.safetensors"))))
    here = {**this_card(), "weights": weights,
            "digests": {key: digest(got["alone"].contiguous().numpy().tobytes())
                        for key, got in sorted(first["scores"].items())}}
    report(test="same bits on every card", **here)
    if os.environ.get("DQ_RECORD_DIGESTS"):
        Path(os.environ["DQ_RECORD_DIGESTS"]).write_text(json.dumps(here, indent=1) + "\n")
    records = json.loads(DIGESTS.read_text())["records"] if DIGESTS.exists() else []
    same = [r for r in records if r["software"] == here["software"] and r["weights"] == here["weights"]]
    if not same:
        pytest.skip(f"no record of this software ({here['software']}) and weights in {DIGESTS.name}: this "
                    f"card's digests are in the report (DQ_RECORD_DIGESTS=path writes them)")
    for record in same:
        differ = sorted(k for k in record["digests"] if record["digests"][k] != here["digests"].get(k))
        where = (f"{record['card']} ({record['multiprocessors']} multiprocessors) recorded them; this is "
                 f"{here['card']} ({here['multiprocessors']})")
        assert not differ, f"deterministic mode's bits differ from the record for {differ}: {where}"
        assert set(record["digests"]) == set(here["digests"]), f"another held-out set than the record's: {where}"
