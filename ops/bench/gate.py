"""The gate's verdict: every target of issue 48 (and what issue 49 reports), read from an OUTDIR's stage reports.

    python ops/bench/gate.py OUT                  # writes OUT/gate.json and OUT/gate.md, prints the table
    python ops/bench/gate.py OUT --baseline BASE  # and a baseline beside it (BASE: an OUTDIR or a gate.json)
    python ops/bench/gate.py --digest             # this checkout's source digest, to match a gate.json's

ops/bench/gate.sh runs the stages (ops/bench/run_all.sh) and this after each part; what a stage did not leave
is "not measured", with the reason from OUT/gate-stages.jsonl. The targets are one list, ``TARGETS``
(gate_targets.py): a new stage's figure is one entry there. ``ops/bench/check_gate.py`` reads the file this
writes.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gate_targets import STAGES, TARGETS, Target, passes  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = 1
SOURCES = ("producer", "worker", "ops/bench")  # what the digest covers: the code the figures measure


def source_digest(root: Path = ROOT) -> str:
    """sha256 over the Python and shell sources of ``SOURCES`` (path and bytes, sorted): the same tree gives the
    same digest with or without git, so a gate.json can be matched to a checkout."""
    digest = hashlib.sha256()
    for folder in SOURCES:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix in (".py", ".sh") and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def read_reports(out: Path, shape: str) -> dict[str, object]:
    """Each stage's report.json (None where absent); the priority stage as a list of its workers' reports."""
    reports: dict[str, object] = {}
    for key, folders in STAGES.values():
        found = []
        for folder in folders:
            path = out / folder.format(shape=shape) / "report.json"
            found.append(json.loads(path.read_text()) if path.is_file() else None)
        reports[key] = found if len(folders) > 1 else found[0]
    return reports


def stage_log(out: Path) -> dict[str, dict]:
    """The last entry per stage of OUT/gate-stages.jsonl (gate.sh: part, seconds, exit, skipped)."""
    path, last = out / "gate-stages.jsonl", {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                last[entry["stage"]] = entry
    return last


def why_not(target: Target, log: dict[str, dict]) -> str:
    entry = log.get(target.stage)
    if entry is None:
        return f"not measured: stage {target.stage} not run"
    if entry.get("skipped"):
        return f"not measured: stage {target.stage} skipped ({entry['skipped']})"
    if entry.get("exit") == 124:
        return f"not measured: stage {target.stage} cut at its limit of {entry.get('limit_s')} s"
    return f"not measured: stage {target.stage} exited {entry.get('exit')}"


def machine(out: Path, reports: dict[str, object], earlier: bool = False) -> tuple[str, str]:
    """The card (the stages' own word for it) and the commit (COMMIT, else machine.txt's, else git's; an
    ``earlier`` run's folder: machine.txt's alone, since COMMIT and git name this run's)."""
    cards = set()
    for report in reports.values():
        for one in report if isinstance(report, list) else [report]:
            if isinstance(one, dict) and one.get("gpu"):
                cards.add(one["gpu"])
    card = " / ".join(sorted(cards)) or "unknown"
    commit = "" if earlier else os.environ.get("COMMIT", "")
    text = (out / "machine.txt").read_text() if (out / "machine.txt").is_file() else ""
    for line in text.splitlines():
        if line.startswith("commit ") and not commit:
            commit = line[len("commit "):].strip()
    if not commit and not earlier:
        try:
            commit = subprocess.run(["git", "-C", str(ROOT), "log", "--oneline", "-1"], capture_output=True,
                                    text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = ""
    return card, commit.split()[0] if commit else "unknown"


def build(out: Path, shape: str = "2b", smoke: bool = False, earlier: bool = False) -> dict:
    """The gate: every target's figure, comparison and verdict, with the numbers it came from. ``earlier``: a
    baseline's folder, whose source this checkout is not (no digest)."""
    reports, log = read_reports(out, shape), stage_log(out)
    card, commit = machine(out, reports, earlier)
    targets = []
    for target in TARGETS:
        figure, raw = target.figure(reports)
        entry = {"key": target.key, "name": target.name, "issue": target.issue, "gating": target.gating,
                 "unit": target.unit, "figure": figure, "target": target.target,
                 "comparison": target.comparison,
                 "pass": passes(figure, target.target, target.comparison), "stage": target.stage,
                 "source": target.source, "note": raw.pop("note", "") if isinstance(raw, dict) else "",
                 "raw": raw}
        if figure is None and not entry["note"]:
            entry["note"] = why_not(target, log)
        targets.append(entry)
    return {"schema": SCHEMA, "measured": not smoke and any(t["figure"] is not None for t in targets),
            "smoke": smoke, "shape": shape, "commit": commit,
            "source_digest": None if earlier else source_digest(), "card": card,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "targets": targets, "stages": list(log.values())}


def shown(value, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "tokens/s":
        return f"{value / 1000:.1f}k"
    if unit in ("share", "load"):
        return f"{value:.1%}" if unit == "share" else f"{value:.2f} x peak"
    if unit == "ms":
        return f"{value:.1f} ms"
    return f"{value:.3f}" + ("x" if unit == "x floor" else "")


def wanted(entry: dict) -> str:
    return "-" if entry["comparison"] is None else f"{entry['comparison']} {shown(entry['target'], entry['unit'])}"


def verdict(entry: dict) -> str:
    if entry["comparison"] is None:
        return "-"
    if entry["pass"] is None:
        return "not measured"
    met = "met" if entry["pass"] else "MISSED"
    return met if entry["gating"] else f"{met} (reported)"


def heading(gate: dict) -> str:
    kind = "SMOKE (CPU harness, not the product's figures)" if gate.get("smoke") else (
        "measured" if gate.get("measured") else "NOT MEASURED")
    return (f"gate at {gate.get('commit')} (source {gate.get('source_digest') or '-'}) on {gate.get('card')}, "
            f"{gate.get('date')}: {kind}")


def table(gate: dict) -> str:
    lines = [heading(gate), "", "| target | figure | target | verdict | from |", "|---|---|---|---|---|"]
    for entry in gate["targets"]:
        where = entry["note"] if entry["figure"] is None or entry["note"] else entry["source"]
        lines.append(f"| {entry['name']} | {shown(entry['figure'], entry['unit'])} | {wanted(entry)} | "
                     f"{verdict(entry)} | {where} |")
    failed = [e["name"] for e in gate["targets"] if e["gating"] and e["pass"] is not True]
    lines += ["", f"gating targets not met: {len(failed)} of {sum(e['gating'] for e in gate['targets'])}"]
    return "\n".join(lines) + "\n"


def side_by_side(base: dict, now: dict) -> str:
    """Both gates' figures per target, the baseline's first."""
    before = {entry["key"]: entry for entry in base["targets"]}
    lines = [f"baseline: {heading(base)}", f"now:      {heading(now)}", "",
             f"| target | baseline {base.get('commit')} | now {now.get('commit')} | target | now |",
             "|---|---|---|---|---|"]
    for entry in now["targets"]:
        old = before.get(entry["key"], {})
        lines.append(f"| {entry['name']} | {shown(old.get('figure'), entry['unit'])} | "
                     f"{shown(entry['figure'], entry['unit'])} | {wanted(entry)} | {verdict(entry)} |")
    return "\n".join(lines) + "\n"


def load_gate(path: Path, shape: str) -> dict:
    """A gate.json, or an OUTDIR (its gate.json if there, else built from its stage reports)."""
    if path.is_file():
        return json.loads(path.read_text())
    if (path / "gate.json").is_file():
        return json.loads((path / "gate.json").read_text())
    return build(path, shape, earlier=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", help="the gate's OUTDIR")
    parser.add_argument("--baseline", help="an earlier gate's OUTDIR or gate.json, printed beside")
    parser.add_argument("--shape", default=os.environ.get("BENCH_SHAPE", "2b"))
    parser.add_argument("--smoke", action="store_true", default=os.environ.get("GATE_SMOKE") == "1",
                        help="the CPU harness check: its figures are marked as not the product's")
    parser.add_argument("--digest", action="store_true", help="print this checkout's source digest and exit")
    args = parser.parse_args()
    if args.digest:
        print(source_digest())
        return 0
    if not args.out:
        parser.error("OUT is required")
    out = Path(args.out)
    gate = build(out, args.shape, args.smoke)
    (out / "gate.json").write_text(json.dumps(gate, indent=1) + "\n")
    (out / "gate.md").write_text(table(gate))
    print(table(gate))
    if args.baseline:
        print(side_by_side(load_gate(Path(args.baseline), args.shape), gate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
