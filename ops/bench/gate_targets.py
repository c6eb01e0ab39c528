"""The gate's targets, one list: each entry names its figure, the target, the comparison and the stage whose
report holds it (ops/bench/gate.py reads them; ops/bench/check_gate.py holds a gate.json to them).

A new figure is one more ``Target``: a key, what it is, the issue that sets it, its unit, the target and
comparison (None for a figure shown without one), whether it gates (issue 48's do; issue 49's are reported
until that issue), the stage (ops/bench/gate.sh's name) and a function from the reports to the figure and the
numbers beside it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable

# gate.sh's stage -> the key its reports are read under, and their folders under OUTDIR (run_all.sh's names;
# {shape}: 2b, or tiny in the CPU harness check). gate.sh asks this list (``python3 gate_targets.py folders``).
STAGES = {
    "e2e-bf16": ("e2e", ("e2e-{shape}-bf16",)),
    "e2e-bf16-nondet": ("e2e_nondet", ("e2e-{shape}-bf16-nondet",)),
    "lone": ("lone", ("lone-{shape}-bf16",)),
    "priority": ("priority", ("priority-{shape}-bf16", "priority-{shape}-bf16-2", "priority-{shape}-bf16-3")),
    "invariance-det": ("invariance_det", ("invariance-det-{shape}-bf16",)),
    "fidelity-floor": ("floor", ("fidelity-floor",)),
}
COMPARISONS = {"<=": lambda figure, target: figure <= target, ">=": lambda figure, target: figure >= target}
Figure = Callable[[dict], "tuple[float | None, dict[str, Any]]"]


@dataclass(frozen=True)
class Target:
    """One row of the gate."""

    key: str
    name: str
    issue: int
    unit: str  # ms, ratio, x floor, share, tokens/s, load
    target: float | None
    comparison: str | None  # <=, >=, or None: shown without a target
    gating: bool
    stage: str
    source: str
    figure: Figure


def passes(figure: float | None, target: float | None, comparison: str | None) -> bool | None:
    if comparison is None or figure is None:
        return None
    return bool(COMPARISONS[comparison](figure, target))


def _phase(reports: dict, load: float) -> dict | None:
    e2e = reports.get("e2e") or {}
    return next((p for p in e2e.get("sweep", []) if abs(p["load"] - load) < 1e-9), None)


def _p99_at(load: float) -> Figure:
    def figure(reports: dict):
        phase = _phase(reports, load)
        return (None, {}) if phase is None else (phase["p99_ms"], {"p50_ms": phase["p50_ms"],
                                                                  "requests": phase["requests"]})
    return figure


def _p99_up_to(load: float) -> Figure:
    def figure(reports: dict):
        sweep = [p for p in (reports.get("e2e") or {}).get("sweep", []) if p["load"] <= load + 1e-9]
        if not sweep or max(p["load"] for p in sweep) < load - 1e-9:
            return None, {}
        worst = max(sweep, key=lambda p: p["p99_ms"])
        by_load = {p["load"]: p["p99_ms"] for p in sweep}
        return worst["p99_ms"], {"at_load": worst["load"], "p99_ms_by_load": by_load}
    return figure


def crossing(sweep: list[dict], limit: float) -> tuple[float | None, float | None]:
    """The offered load (x the peak) at which p99 first exceeds ``limit`` ms, interpolated between phases (None if
    it never does), and the highest load it stayed under it up to."""
    below = None
    for phase in sweep:
        if phase["p99_ms"] > limit:
            at = phase["load"] if below is None else below[0] + (phase["load"] - below[0]) * (
                limit - below[1]) / (phase["p99_ms"] - below[1])
            return at, below[0] if below else None
        below = (phase["load"], phase["p99_ms"])
    return None, below[0] if below else None


def _crossing(limit: float) -> Figure:
    def figure(reports: dict):
        at, under = crossing((reports.get("e2e") or {}).get("sweep", []), limit)
        if at is None and under is not None:
            return None, {"note": f"p99 stays under {limit:g} ms up to {under:g} x the peak"}
        return at, {}
    return figure


def _e2e(path: tuple[str, ...], key: str = "e2e") -> Figure:
    def figure(reports: dict):
        value: Any = reports.get(key)
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        return value, {}
    return figure


def _priority(field: str, worst) -> Figure:
    """The worst of the fresh priority workers' runs; not measured unless all three gave a report."""
    def figure(reports: dict):
        workers = [r for r in reports.get("priority") or [] if r]
        runs = [run for worker in workers for run in worker.get("runs", [])]
        per_worker = [[run[field] for run in worker.get("runs", [])] for worker in workers]
        raw = {"per_worker": per_worker, "workers": len(workers),
               "peaks": [w["peak"]["tokens_per_s"] for w in workers]}
        wanted = len(STAGES["priority"][1])
        if not workers:
            return None, {}  # the stage's own word says why
        if len(workers) < wanted or not runs:
            return None, {**raw, "note": f"measured in {len(workers)} of {wanted} fresh workers"}
        return worst(run[field] for run in runs), raw
    return figure


def _lone(path: str, field: str) -> Figure:
    def figure(reports: dict):
        lone = (reports.get("lone") or {}).get(path)
        if not lone:
            return None, {}
        return lone[field], {k: lone.get(k) for k in ("count", "mean_ms", "max_ms")}
    return figure


def _fidelity(config: str, field: str) -> Figure:
    def figure(reports: dict):
        floor = reports.get("floor") or {}
        got = floor.get("configs", {}).get(config)
        if not got:
            failed = floor.get("failed", {}).get(config)
            return None, ({"note": f"not measured: {failed}"} if failed else {})
        raw = {"figure": got["vs_fp32"][field], "floor": floor["floor"][field],
               "max": got["vs_fp32"].get("max"), "floor_max": floor["floor"].get("max"),
               "flips": got["vs_fp32"]["flips"], "settings": got["settings"], "set": floor.get("set")}
        if floor.get("overridden"):
            raw["note"] = f"settings overridden: {floor['overridden']}"
        return got[f"{field}_ratio"], raw
    return figure


def _bitwise(reports: dict):
    report = reports.get("invariance_det")
    if not report or not report.get("held_out"):
        return None, {}
    if not report.get("deterministic"):
        return None, {"note": "the invariance report is not deterministic mode's"}
    return report["identical"] / report["held_out"], {
        "identical": report["identical"], "held_out": report["held_out"],
        "kinds": {kind: f"{k['identical']} of {k['requests']}"
                  for kind, k in report.get("kinds", {}).items()}}


def _fresh_peaks(reports: dict):
    """Every fresh bf16 worker's end-to-end peak (end_to_end.py's and each priority worker's peak phase: the same
    3000-request backlog after the same warm-up); the median of those there."""
    peaks = {"e2e-bf16": ((reports.get("e2e") or {}).get("peak") or {}).get("tokens_per_s")}
    for number, report in enumerate(reports.get("priority") or [], 1):
        peaks[f"priority worker {number}"] = (report or {}).get("peak", {}).get("tokens_per_s")
    found = [value for value in peaks.values() if value]
    if not found:
        return None, {}
    said = "one fresh worker's peak" if len(found) == 1 else f"median of {len(found)} fresh workers' peaks"
    return statistics.median(found), {"peaks": peaks, "note": said}


def _det_cost(reports: dict):
    """e2e-bf16 runs the defaults (deterministic mode where its kernels run), e2e-bf16-nondet its twin without."""
    default, twin = reports.get("e2e") or {}, reports.get("e2e_nondet") or {}
    det = (default.get("peak") or {}).get("tokens_per_s")
    other = (twin.get("peak") or {}).get("tokens_per_s")
    if not det or not other:
        return None, {}
    if default.get("deterministic") is not True or twin.get("deterministic") is not False:
        return None, {"note": f"the defaults' worker ran deterministic={default.get('deterministic')}, the "
                              f"twin's {twin.get('deterministic')}: not deterministic mode against its twin"}
    return 1 - det / other, {"deterministic_tokens_per_s": det, "twin_tokens_per_s": other}


TARGETS: list[Target] = [
    Target("e2e_over_in_process", "end-to-end peak over in process (bf16)", 48, "ratio", 0.97, ">=", True,
           "e2e-bf16", "e2e-bf16: peak / in process", _e2e(("end_to_end_over_in_process",))),
    Target("p99_at_half", "p99 at 0.5 of the peak", 48, "ms", 50, "<=", True,
           "e2e-bf16", "e2e-bf16 sweep, phase 0.5", _p99_at(0.5)),
    Target("p99_up_to_0.8", "p99 up to 0.8 of the peak (worst phase)", 48, "ms", 100, "<=", True,
           "e2e-bf16", "e2e-bf16 sweep, phases up to 0.8", _p99_up_to(0.8)),
    Target("high_p99", "high lane p99 (worst of three fresh workers)", 48, "ms", 150, "<=", True,
           "priority", "priority workers 1-3", _priority("high_p99_ms", max)),
    Target("normal_share", "normal lane over the peak (worst of three fresh workers)", 48, "share", 0.85, ">=",
           True, "priority", "priority workers 1-3", _priority("normal_over_peak", min)),
    Target("lone_p50", "lone request p50, through the client", 48, "ms", 10, "<=", True,
           "lone", "lone: client", _lone("client", "p50_ms")),
    Target("lone_p99", "lone request p99, through the client", 48, "ms", 15, "<=", True,
           "lone", "lone: client", _lone("client", "p99_ms")),
    Target("defaults_mean", "fast engine defaults (deterministic mode): mean difference over the bf16 floor", 48,
           "x floor", 1.1, "<=", True, "fidelity-floor", "fidelity-floor: defaults", _fidelity("defaults", "mean")),
    Target("defaults_p99", "fast engine defaults (deterministic mode): p99 difference over the bf16 floor", 48,
           "x floor", 1.1, "<=", True, "fidelity-floor", "fidelity-floor: defaults", _fidelity("defaults", "p99")),
    Target("nondeterministic_mean", "--no-deterministic: mean difference over the bf16 floor", 48, "x floor",
           1.1, "<=", True, "fidelity-floor", "fidelity-floor: nondeterministic",
           _fidelity("nondeterministic", "mean")),
    Target("nondeterministic_p99", "--no-deterministic: p99 difference over the bf16 floor", 48, "x floor",
           1.1, "<=", True, "fidelity-floor", "fidelity-floor: nondeterministic",
           _fidelity("nondeterministic", "p99")),
    Target("deterministic_bitwise", "deterministic mode: held-out requests bitwise equal alone and mixed", 48,
           "share", 1.0, ">=", True, "invariance-det", "invariance-det", _bitwise),
    Target("epilogues_mean", "epilogue kernels (residual,swiglu; off by default): mean over the bf16 floor", 48,
           "x floor", 1.1, "<=", False, "fidelity-floor", "fidelity-floor: epilogues",
           _fidelity("epilogues", "mean")),
    Target("epilogues_p99", "epilogue kernels (residual,swiglu; off by default): p99 over the bf16 floor", 48,
           "x floor", 1.1, "<=", False, "fidelity-floor", "fidelity-floor: epilogues",
           _fidelity("epilogues", "p99")),
    # Issue 49's: reported, not counted.
    Target("bf16_end_to_end", "bf16 end to end tokens/s (median of fresh workers)", 49, "tokens/s", 200_000,
           ">=", False, "e2e-bf16", "e2e-bf16 and priority workers' peaks", _fresh_peaks),
    Target("deterministic_cost", "deterministic mode's cost against its twin (end to end)", 49, "share", 0.02,
           "<=", False, "e2e-bf16-nondet", "1 - e2e-bf16 / e2e-bf16-nondet", _det_cost),
    # Shown without a target.
    Target("in_process", "in-process peak (bf16)", 48, "tokens/s", None, None, False,
           "e2e-bf16", "e2e-bf16: in process", _e2e(("in_process", "tokens_per_s"))),
    Target("p99_at_0.8", "p99 at 0.8 of the peak", 48, "ms", None, None, False,
           "e2e-bf16", "e2e-bf16 sweep, phase 0.8", _p99_at(0.8)),
    Target("crosses_50", "load where p99 crosses 50 ms", 48, "load", None, None, False,
           "e2e-bf16", "e2e-bf16 sweep", _crossing(50)),
    Target("crosses_100", "load where p99 crosses 100 ms", 48, "load", None, None, False,
           "e2e-bf16", "e2e-bf16 sweep", _crossing(100)),
    Target("gateway_p50", "lone request p50, through the gateway's /v1/decide", 48, "ms", None, None, False,
           "lone", "lone: gateway", _lone("gateway", "p50_ms")),
    Target("gateway_p99", "lone request p99, through the gateway's /v1/decide", 48, "ms", None, None, False,
           "lone", "lone: gateway", _lone("gateway", "p99_ms")),
    Target("nondeterministic_p99_at_half", "--no-deterministic: p99 at 0.5 of its peak", 49, "ms", None, None,
           False, "e2e-bf16-nondet", "e2e-bf16-nondet, phase 0.5", _e2e(("latency", "p99_ms"), "e2e_nondet")),
]


if __name__ == "__main__":  # gate.sh: python3 gate_targets.py folders STAGE SHAPE -> the stage's folders
    import sys

    _, _, stage, shape = sys.argv
    print(" ".join(folder.format(shape=shape) for folder in STAGES[stage][1]))
