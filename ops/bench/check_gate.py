"""Holds a gate.json (ops/bench/gate.py) to its targets.

    python ops/bench/check_gate.py docs/gate.json

Exit status: 0 every gating target met; 1 a gating target missed or not measured in a measured gate; 2 the
file is malformed (what is wrong is printed); 3 well formed but not a measurement of the product
(``"measured": false``: the placeholder committed before a GPU run, or the CPU harness check, ``"smoke":
true``). Issue 49's figures and those without a target are shown, never counted. CI checks only that the
committed file is well formed (tests/unit/test_gate.py): a missed target still lands, and the file says so.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gate_targets import COMPARISONS, passes  # noqa: E402

TOP = {"schema": int, "measured": bool, "smoke": bool, "commit": str, "card": str, "date": str,
       "targets": list}
ENTRY = {"key": str, "name": str, "issue": int, "gating": bool, "unit": str, "stage": str, "source": str,
         "note": str}
NUMBER = (int, float)


def problems(gate: object) -> list[str]:
    """What makes ``gate`` malformed (empty: well formed)."""
    if not isinstance(gate, dict):
        return ["the file is not a JSON object"]
    found = [f"{key}: missing or not {kind.__name__}" for key, kind in TOP.items()
             if not isinstance(gate.get(key), kind) or (kind is int and isinstance(gate.get(key), bool))]
    if found:
        return found
    if gate["schema"] != 1:
        found.append(f"schema: {gate['schema']}, this checker reads 1")
    if not gate["commit"].strip():
        found.append("commit: empty")
    if gate["smoke"] and gate["measured"]:
        found.append("a smoke run is never a measurement: measured must be false")
    if not gate["targets"]:
        found.append("targets: empty")
    keys = set()
    for number, entry in enumerate(gate["targets"]):
        where = f"targets[{number}]"
        if not isinstance(entry, dict):
            found.append(f"{where}: not an object")
            continue
        where = f"targets[{number}] ({entry.get('key')})"
        found += [f"{where}.{key}: missing or not {kind.__name__}" for key, kind in ENTRY.items()
                  if not isinstance(entry.get(key), kind) or (kind is int and isinstance(entry.get(key), bool))]
        if entry.get("key") in keys:
            found.append(f"{where}: key repeated")
        keys.add(entry.get("key"))
        found += entry_problems(where, entry, gate)
    return found


def entry_problems(where: str, entry: dict, gate: dict) -> list[str]:
    found = []
    figure, target, comparison = entry.get("figure"), entry.get("target"), entry.get("comparison")
    for name, value in (("figure", figure), ("target", target)):
        number = isinstance(value, NUMBER) and not isinstance(value, bool)
        if value is not None and (not number or not math.isfinite(value)):
            found.append(f"{where}.{name}: not a finite number or null")
    if comparison is not None and comparison not in COMPARISONS:
        found.append(f"{where}.comparison: {comparison!r}, not one of {', '.join(COMPARISONS)} or null")
    if (comparison is None) != (target is None):
        found.append(f"{where}: a target needs a comparison, and a comparison a target")
    if entry.get("gating") and comparison is None:
        found.append(f"{where}: gating without a target")
    if not found and entry.get("pass") != passes(figure, target, comparison):
        found.append(f"{where}.pass: {entry.get('pass')!r}, but {figure} {comparison} {target} says "
                     f"{passes(figure, target, comparison)!r}")
    if not gate["measured"] and not gate["smoke"] and figure is not None:
        found.append(f"{where}.figure: a gate not measured holds no figures")
    if figure is None and not str(entry.get("note", "")).strip():
        found.append(f"{where}.note: a figure not measured says why")
    return found


def check(path: Path) -> tuple[int, list[str]]:
    """The exit status and the lines to print."""
    try:
        gate = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return 2, [f"{path}: {error}"]
    found = problems(gate)
    if found:
        return 2, [f"{path}: malformed"] + [f"  {problem}" for problem in found]
    if gate["smoke"]:
        return 3, [f"{path}: well formed; the CPU harness check (smoke), not a measurement of the product"]
    if not gate["measured"]:
        return 3, [f"{path}: well formed; not measured (no gate run on a GPU; commit {gate['commit']})"]
    missed = [entry for entry in gate["targets"] if entry["gating"] and entry["pass"] is not True]
    lines = [f"{path}: gate at {gate['commit']} on {gate['card']}, {gate['date']}"]
    for entry in gate["targets"]:
        if entry["comparison"] is None:
            continue
        state = {True: "met", False: "MISSED", None: "not measured"}[entry["pass"]]
        counted = "" if entry["gating"] else f" (issue {entry['issue']}: reported, not counted)"
        lines.append(f"  {state:12} {entry['name']}: {entry['figure']} {entry['comparison']} {entry['target']}"
                     f"{counted}{' - ' + entry['note'] if entry['note'] else ''}")
    lines.append(f"{len(missed)} gating target(s) not met" if missed else "every gating target met")
    return (1 if missed else 0), lines


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: check_gate.py GATE.json", file=sys.stderr)
        return 2
    code, lines = check(Path(argv[0]))
    print("\n".join(lines))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
