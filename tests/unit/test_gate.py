"""The gate's pieces that need no GPU (ops/bench/gate.py, gate_targets.py, check_gate.py, fidelity_set.py, the
parts in gate.sh and run_all.sh): the committed docs/gate.json is well formed; a gate built from stage reports
holds each target to its comparison, says why a figure is missing, and prints its table and a baseline beside
it; check_gate.py's exit status for met, missed, not measured and malformed files; the fidelity set's spread.
The whole harness on the CPU is a documented command (docs/BENCHMARKS.md, "The gate"), minutes long."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "ops" / "bench"
sys.path.insert(0, str(BENCH))

import check_gate  # noqa: E402
import gate  # noqa: E402
from gate_targets import STAGES, TARGETS  # noqa: E402

CARD = "NVIDIA H100 80GB HBM3"
SWEEP = [(0.1, 14, 18), (0.3, 13, 30), (0.5, 30, 44), (0.6, 33, 60), (0.7, 35, 70), (0.8, 36, 90),
         (0.9, 45, 120), (1.0, 70, 150)]  # load, p50, p99


def fidelity(mean: float, p99: float) -> dict:
    """A configuration's figures against a floor of 0.003 mean and 0.009 p99."""
    return {"vs_fp32": {"questions": 775, "mean": mean, "p99": p99, "max": 2 * p99, "flips": 0.01},
            "mean_ratio": mean / 0.003, "p99_ratio": p99 / 0.009, "mean_within": mean / 0.003 <= 1.1,
            "p99_within": p99 / 0.009 <= 1.1, "settings": {"epilogues": "none"}, "gated": True}


def reports() -> dict[str, dict]:
    """Stage folder -> report.json, in the shapes the benchmarks write (the keys the gate reads)."""
    priority = {"gpu": CARD, "peak": {"tokens_per_s": 178_000},
                "runs": [{"high_p99_ms": 120, "normal_over_peak": 0.87}]}
    return {
        "e2e-2b-bf16": {"gpu": CARD, "deterministic": True, "peak": {"tokens_per_s": 180_000},
                        "in_process": {"tokens_per_s": 184_000},
                        "end_to_end_over_in_process": 0.978,
                        "sweep": [{"load": load, "p50_ms": p50, "p99_ms": p99, "requests": 500}
                                  for load, p50, p99 in SWEEP]},
        "e2e-2b-bf16-nondet": {"gpu": CARD, "deterministic": False, "peak": {"tokens_per_s": 183_000},
                               "latency": {"load": 0.5, "p99_ms": 47}},
        "lone-2b-bf16": {"gpu": CARD, "client": {"p50_ms": 9.2, "p99_ms": 13.5, "count": 800, "mean_ms": 9.4,
                                                  "max_ms": 21},
                         "gateway": {"p50_ms": 10.1, "p99_ms": 16.0, "count": 800, "mean_ms": 10.3, "max_ms": 30}},
        "priority-2b-bf16": priority, "priority-2b-bf16-2": priority, "priority-2b-bf16-3": priority,
        "invariance-det-2b-bf16": {"gpu": CARD, "deterministic": True, "held_out": 34, "identical": 34,
                                   "kinds": {"standard": {"identical": 24, "requests": 24}}},
        "fidelity-floor": {"gpu": CARD, "floor": {"questions": 775, "mean": 0.003, "p99": 0.009, "max": 0.02, "flips": 0.01},
                           "configs": {"defaults": fidelity(0.0031, 0.0095),
                                       "nondeterministic": fidelity(0.0032, 0.0090)},
                           "failed": {}, "overridden": {}, "set": {"prompts": 320}},
    }


def write(out: Path, found: dict[str, dict], stages: list[dict] = ()) -> Path:
    for folder, report in found.items():
        (out / folder).mkdir(parents=True, exist_ok=True)
        (out / folder / "report.json").write_text(json.dumps(report))
    (out / "machine.txt").write_text(f"{CARD}, 81559 MiB\ncommit abc1234 the handed-in commit\n")
    (out / "gate-stages.jsonl").write_text("".join(json.dumps(stage) + "\n" for stage in stages))
    return out


def built(tmp_path: Path, found: dict | None = None, stages: list[dict] = (), **options) -> dict:
    out = write(tmp_path / "out", reports() if found is None else found, stages)
    result = gate.build(out, **options)
    (out / "gate.json").write_text(json.dumps(result))
    return result


def verdicts(result: dict) -> dict[str, object]:
    return {entry["key"]: entry["pass"] for entry in result["targets"]}


def status(path: Path) -> int:
    return check_gate.check(path)[0]


def test_the_committed_gate_is_well_formed():
    code, lines = check_gate.check(ROOT / "docs" / "gate.json")
    assert code in (0, 1, 3), "\n".join(lines)  # a missed or unmeasured target lands; a malformed file not


def test_a_gate_of_met_targets_passes_and_each_figure_is_read_where_the_target_says(tmp_path, monkeypatch):
    monkeypatch.delenv("COMMIT", raising=False)
    result = built(tmp_path)
    figures = {entry["key"]: entry["figure"] for entry in result["targets"]}
    assert (result["commit"], result["card"], result["measured"], result["smoke"]) == ("abc1234", CARD, True,
                                                                                      False)
    assert figures["p99_at_half"] == 44 and figures["p99_up_to_0.8"] == 90 and figures["p99_at_0.8"] == 90
    assert figures["e2e_over_in_process"] == 0.978
    assert figures["lone_p50"] == 9.2 and figures["lone_p99"] == 13.5
    assert figures["high_p99"] == 120 and figures["normal_share"] == 0.87
    assert figures["deterministic_bitwise"] == 1.0
    assert figures["bf16_end_to_end"] == 178_000  # the median of e2e-bf16's 180k and three workers' 178k
    assert figures["deterministic_cost"] == pytest.approx(1 - 180 / 183)  # the defaults against their twin
    assert figures["nondeterministic_p99_at_half"] == 47
    # where the defaults did not run deterministic mode (not a Hopper card), there is no cost to read
    found = reports()
    found["e2e-2b-bf16"]["deterministic"] = False
    cost = next(e for e in built(tmp_path / "other", found)["targets"] if e["key"] == "deterministic_cost")
    assert cost["figure"] is None and "ran deterministic=False" in cost["note"]
    assert figures["crosses_100"] == pytest.approx(0.8 + 0.1 * 10 / 30)
    assert figures["crosses_50"] == pytest.approx(0.5 + 0.1 * 6 / 16)
    assert figures["defaults_mean"] == pytest.approx(0.0031 / 0.003)
    assert all(verdicts(result)[t.key] for t in TARGETS if t.gating)
    assert verdicts(result)["bf16_end_to_end"] is False  # issue 49's 200k: reported, not counted
    assert status(tmp_path / "out" / "gate.json") == 0


def test_a_missed_target_fails_the_gate_and_a_missing_worker_is_not_measured(tmp_path):
    found = reports()
    found["lone-2b-bf16"]["client"]["p99_ms"] = 17.9
    found["e2e-2b-bf16"]["sweep"][5]["p99_ms"] = 101  # the phase at 0.8
    del found["priority-2b-bf16-3"]
    stages = [{"part": "gate-2", "stage": "priority", "exit": 124, "limit_s": 110, "skipped": ""}]
    result = built(tmp_path, found, stages)
    entries = {entry["key"]: entry for entry in result["targets"]}
    assert entries["lone_p99"]["pass"] is False and entries["p99_up_to_0.8"]["pass"] is False
    assert entries["high_p99"]["figure"] is None and entries["high_p99"]["pass"] is None
    assert "2 of 3" in entries["high_p99"]["note"]
    assert entries["lone_p50"]["pass"] is True
    code, lines = check_gate.check(tmp_path / "out" / "gate.json")
    assert code == 1 and any("MISSED" in line and "lone request p99" in line for line in lines)


def test_a_stage_not_run_says_why(tmp_path):
    found = {k: v for k, v in reports().items() if not k.startswith(("fidelity", "invariance"))}
    stages = [{"part": "gate-2", "stage": "fidelity-floor", "skipped": "100 s left in gate-2, 170 expected"}]
    entries = {entry["key"]: entry for entry in built(tmp_path, found, stages)["targets"]}
    assert entries["defaults_mean"]["note"].startswith("not measured: stage fidelity-floor skipped (100 s")
    assert entries["deterministic_bitwise"]["note"] == "not measured: stage invariance-det not run"
    assert status(tmp_path / "out" / "gate.json") == 1


def test_the_table_and_the_baseline_beside_it(tmp_path):
    now = built(tmp_path)
    base = copy.deepcopy(now)
    base["commit"] = "0ld0ld0"
    for entry in base["targets"]:
        if entry["key"] == "lone_p50":
            entry["figure"] = 13.4
    text = gate.table(now)
    assert "abc1234" in text and CARD in text and "gating targets not met: 0 of" in text
    assert "| lone request p50, through the client | 9.2 ms | <= 10.0 ms | met |" in text
    beside = gate.side_by_side(base, now)
    assert "baseline 0ld0ld0" in beside
    assert "| lone request p50, through the client | 13.4 ms | 9.2 ms |" in beside
    (tmp_path / "base.json").write_text(json.dumps(base))
    printed = subprocess.run([sys.executable, str(BENCH / "gate.py"), str(tmp_path / "out"), "--baseline",
                              str(tmp_path / "base.json")], capture_output=True, text=True, check=True).stdout
    assert "13.4 ms | 9.2 ms" in printed and (tmp_path / "out" / "gate.md").read_text() in printed


def test_a_baseline_folder_keeps_its_own_commit_and_claims_no_digest(tmp_path, monkeypatch):
    """An earlier run's folder without its gate.json is built from its reports: its commit is its machine.txt's,
    not this run's COMMIT, and no source digest is claimed for it (the digest is of this checkout)."""
    monkeypatch.setenv("COMMIT", "n3wn3w0")
    folder = write(tmp_path / "base", reports(), [])
    base = gate.load_gate(folder, "2b")
    assert base["commit"] == "abc1234" and base["source_digest"] is None
    assert "(source -)" in gate.heading(base) and gate.build(folder)["commit"] == "n3wn3w0"


def test_a_smoke_gate_is_well_formed_and_never_taken_for_a_measurement(tmp_path):
    found = {k.replace("-2b-", "-tiny-"): v for k, v in reports().items()}
    result = built(tmp_path, found, shape="tiny", smoke=True)
    assert result["smoke"] and not result["measured"] and "SMOKE" in gate.table(result)
    assert status(tmp_path / "out" / "gate.json") == 3


def bad(path: Path, change) -> int:
    gate_file = json.loads(path.read_text())
    change(gate_file)
    path.write_text(json.dumps(gate_file))
    return status(path)


@pytest.mark.parametrize("change", [
    lambda g: g.pop("commit"),
    lambda g: g.update(schema=2),
    lambda g: g.update(targets=[]),
    lambda g: g["targets"][0].update(figure="fast"),
    lambda g: g["targets"][0].update(comparison="<"),
    lambda g: g["targets"][0].update(target=None),
    lambda g: g["targets"][0].update(**{"pass": not g["targets"][0]["pass"]}),
    lambda g: g["targets"].append(dict(g["targets"][0])),
    lambda g: g.update(measured=False),  # a gate not measured holds no figures
    lambda g: g.update(smoke=True),  # a smoke run is never measured
    lambda g: g["targets"][1].update(figure=None, note="", **{"pass": None}),
], ids=["no commit", "schema", "no targets", "figure", "comparison", "target", "pass", "repeated", "measured",
        "smoke", "no note"])
def test_a_malformed_gate_exits_2(tmp_path, change):
    built(tmp_path)
    assert bad(tmp_path / "out" / "gate.json", change) == 2


def test_not_json_exits_2_and_the_command_line(tmp_path):
    (tmp_path / "gate.json").write_text("{")
    assert status(tmp_path / "gate.json") == 2
    run = subprocess.run([sys.executable, str(BENCH / "check_gate.py"), str(tmp_path / "gate.json")])
    assert run.returncode == 2


def test_the_fidelity_set_spreads_over_every_bucket_and_question_type():
    import fidelity_set

    from producer.wire.schema import Request
    from worker.model import tiny
    from worker.model.encoder import Encoder

    encoder = Encoder(tiny.rendering(max_length=fidelity_set.LONGEST))
    asked = fidelity_set.requests(encoder, 320)
    assert asked == fidelity_set.requests(encoder, 320)  # the same every time
    kinds = {question["type"] for request in asked for question in request["questions"].values()}
    assert kinds == {"noul", "choice", "score"}
    assert sum(len(request["questions"]) > 1 for request in asked) > len(asked) // 2
    prompts = fidelity_set.prompts(encoder, asked)
    assert len(prompts) == len(asked) and max(prompt.length for prompt in prompts) <= 16384
    assert all(count >= 15 for count in fidelity_set.buckets_reached(prompts).values())
    assert Request.model_validate(asked[0])


def test_the_gpu_test_parts_name_existing_modules_and_the_scripts_parse():
    text = (BENCH / "run_all.sh").read_text()
    first = re.search(r"GPU_TESTS_1=\$\{GPU_TESTS_1:-([^}]*)\}", text).group(1).split()
    assert first and all((ROOT / path).is_file() for path in first)
    assert len(first) < len(list((ROOT / "tests" / "gpu").glob("test_*.py")))  # tests-2 runs the others
    for script in ("run_all.sh", "gate.sh"):
        assert subprocess.run(["bash", "-n", str(BENCH / script)]).returncode == 0


def test_every_stage_is_one_list_that_gate_sh_runs_and_asks(tmp_path):
    """gate.sh's stages, the targets' and the report folders are gate_targets.STAGES; gate.sh asks it which
    folders say a stage was measured (a stage it cannot ask about is run, never taken as measured)."""
    text = (BENCH / "gate.sh").read_text()
    run = set(re.findall(r"run_stage ([a-z0-9-]+) ", text))
    assert run == set(STAGES) and {target.stage for target in TARGETS} <= set(STAGES)
    folders = subprocess.run([sys.executable, str(BENCH / "gate_targets.py"), "folders", "priority", "tiny"],
                             capture_output=True, text=True, check=True).stdout.split()
    assert folders == ["priority-tiny-bf16", "priority-tiny-bf16-2", "priority-tiny-bf16-3"]
    for folder in folders:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "report.json").write_text("{}")
    measured = (f'source <(sed -n "/^reports()/,/^}}/p" {BENCH / "gate.sh"}); PY={sys.executable}; shape=tiny; '
                f'out={tmp_path}; measured priority && echo yes; measured lone || echo no; PY=false; '
                'measured priority || echo no')
    got = subprocess.run(["bash", "-c", measured], capture_output=True, text=True, cwd=ROOT).stdout.split()
    assert got == ["yes", "no", "no"]


def test_the_fidelity_measure_gates_on_the_worst_percent_and_reports_the_single_worst():
    """200 questions, three of them far off: p99 is what 99% of them are within (the least far of the three: the
    worst 1% of the set, two questions, is left out), max the single worst; one flip."""
    import torch

    import fidelity_set

    want = [torch.tensor([0.5, 0.5], dtype=torch.float64) for _ in range(200)]
    got = [torch.tensor([0.5 + 0.001 * (i % 3), 0.5 - 0.001 * (i % 3)], dtype=torch.float64) for i in range(200)]
    got[7], got[90] = torch.tensor([0.3, 0.7], dtype=torch.float64), torch.tensor([0.6, 0.4], dtype=torch.float64)
    got[150] = torch.tensor([0.55, 0.45], dtype=torch.float64)
    figures = fidelity_set.compare(got, want)
    assert figures["max"] == pytest.approx(0.2) and figures["p99"] == pytest.approx(0.05)
    assert figures["flips"] == pytest.approx(1 / 200) and figures["questions"] == 200
    within = fidelity_set.against_floor(figures, {"mean": figures["mean"], "p99": 0.048})
    assert within["p99_within"] and within["mean_within"] and within["p99_ratio"] == pytest.approx(0.05 / 0.048)
    assert not fidelity_set.against_floor(figures, {"mean": figures["mean"], "p99": 0.04})["p99_within"]
