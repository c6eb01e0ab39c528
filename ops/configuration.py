"""Writes docs/CONFIGURATION.md from the worker's one settings object (worker/config.py ``Settings``): every field's
flag, variable, default, allowed values and help, in the help's sections. The committed file must match what this
writes (tests/unit/test_docs.py).

    python ops/configuration.py            # write docs/CONFIGURATION.md
    python ops/configuration.py --check    # exit 1 if it differs from what would be written
"""

from __future__ import annotations

import re
import sys
from dataclasses import fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.config import ALIASES, OPTIONAL_SWITCH, SECTIONS, Settings, shown_default  # noqa: E402

DOC = ROOT / "docs" / "CONFIGURATION.md"
HEAD = """# Configuration

<!-- Written by `python ops/configuration.py` from worker/config.py; edit the settings there, not this file. -->

The worker has one settings object (`worker/config.py`, `Settings`): every field below is a flag of
`dq-worker serve` (`python -m worker serve`) and an environment variable; flags win over the environment, the
environment over the defaults. Every value is checked when the settings are made: one out of its range or choices
ends `serve` with exit 2 before the model loads, naming the flag, the variable and what is allowed.
`dq-worker serve --help` lists the same, by section. dq-producer and dq-gateway take the connection's flags and
variables under the same names (docs/CLIENT.md, docs/GATEWAY.md).
"""


def code(text: str) -> str:
    """Flags, variables, URLs' schemes and the like as code."""
    names = r"--[a-z0-9-]+|DQ_[A-Z0-9_]+|[a-z+]+://\S*?(?=[;,)]?(?:\s|$))|usage\.split"
    return re.sub(rf"(?<![`\w])({names})", r"`\1`", text)


def allowed(meta: dict, kind: str) -> str:
    if kind == OPTIONAL_SWITCH:
        return "true, false, auto"
    if meta["choices"]:
        return ", ".join(meta["choices"])
    low, high = meta["low"], meta["high"]
    if low is not None and high is not None:
        return f"{low:g} to {high:g}"
    return f"at least {low:g}" if low is not None else (f"at most {high:g}" if high is not None else "")


def render() -> str:
    out = [HEAD.rstrip("\n")]
    for f in fields(Settings):
        if f.name in SECTIONS:
            out += ["", f"## {SECTIONS[f.name][0].upper()}{SECTIONS[f.name][1:]}", "",
                    "| flag | environment | default | allowed | what |", "|---|---|---|---|---|"]
        meta = f.metadata
        flags = " ".join(f"`{flag}`" for flag in ["--" + f.name.replace("_", "-"), *ALIASES.get(f.name, ())])
        what = code(meta["help"]) + (f"; {code(meta['more'])}" if meta["more"] else "")
        out.append(f"| {flags} | `{Settings.env_name(f.name)}` | `{shown_default(f)}` | {allowed(meta, f.type)} | {what} |")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if DOC.read_text() != text:
            print(f"{DOC.relative_to(ROOT)} differs from worker/config.py: run python ops/configuration.py",
                  file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
