"""The layout shows the architecture, and keeps showing it: no import circle, no import that runs back up the
layers (the wire contract <- the plumbing <- the client <- the commands and the gateway; the wire contract <- the
worker's stages <- the model contract <- the fast engine), each thread's stages in a folder of their own that
imports no other thread's, and files readable in one sitting (README, "Layout")."""

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("producer", "worker")
# Lines of any file of worker/ or producer/: past 300 a file is looked at (is it one role?), past LONGEST it fails.
LONGEST = 400
WIRING = 250  # worker/daemon.py: the stages wired together, nothing else
WIDE, MOST_WIDE = 110, 0.05  # at most 5% of a file's lines over 110 columns (text the code carries aside)
# Files of worker/ over that share when the rule came in, to be wrapped (and then taken off this list): a file on it
# that passes fails the test, so the list only shrinks.
WIDE_FOR_NOW = {"worker/plan/planner.py", "worker/plan/pool.py"}
# Files of worker/ with a pack of assignments continued by a backslash (``a, b = x, \``), to be written in
# parentheses or one assignment a line.
PACKED_FOR_NOW: set[str] = set()

# module prefix -> the only prefixes of this project it may import (at run time).
ONLY = {
    "producer.wire": ["producer.wire"],  # the contract imports nothing else of the project
    "producer.plumbing": ["producer.wire", "producer.plumbing"],  # the plumbing, only the contract
}
# module prefix -> prefixes of this project it must never import (at run time: a TYPE_CHECKING import only names
# a type). A prefix covers the module and everything under it.
ABOVE_THE_CLIENT = ["producer.cli", "producer.admin", "producer.gateway", "producer.local", "producer.__main__"]
NEVER = {
    "producer": ["worker"],  # torch-free, and below every worker
    "producer.client": ABOVE_THE_CLIENT,
    "producer.local": ["producer.client", "producer.cli", "producer.admin", "producer.gateway", "producer.__main__"],
    "producer.admin": ["producer.cli", "producer.gateway", "producer.local", "producer.__main__"],
    "producer.cli": ["producer.gateway", "producer.local"],
    "producer.gateway": ["producer.cli", "producer.local", "producer.__main__"],
    # The HTTP front knows neither the APIs behind it (System One registers its shape) nor the client.
    "producer.gateway.front": ["producer.gateway.systemone", "producer.client", "producer.gateway.routes",
                               "producer.gateway.service", "producer.gateway.cancels", "producer.gateway.openapi",
                               "producer.gateway.batcher", "producer.gateway.__main__"],
    "producer.gateway.systemone": ["producer.gateway.routes", "producer.gateway.openapi", "producer.gateway.cancels",
                                   "producer.gateway.__main__"],
    "worker": ["producer.client", *ABOVE_THE_CLIENT],  # a worker speaks the wire, not the client
    "worker.model": ["worker.fast", "worker.loop", "worker.plan", "worker.gpu", "worker.launch", "worker.daemon",
                     "worker.entries", "worker.tasks", "worker.outcomes", "worker.health", "worker.metrics"],
    "worker.fast": ["worker.loop", "worker.plan", "worker.gpu", "worker.launch", "worker.daemon", "worker.entries",
                    "worker.tasks", "worker.outcomes", "worker.health", "worker.metrics"],
    "worker.loop": ["worker.plan", "worker.gpu", "worker.fast", "worker.model", "worker.launch", "worker.daemon"],
    "worker.plan": ["worker.loop", "worker.gpu", "worker.fast", "worker.launch", "worker.daemon"],
    "worker.gpu": ["worker.loop", "worker.plan", "worker.fast", "worker.launch", "worker.daemon"],
    "worker.launch": ["worker.loop", "worker.plan", "worker.gpu", "worker.fast", "worker.model", "worker.daemon"],
}
# The vocabulary every stage shares imports no stage.
for _module in ("entries", "tasks", "outcomes", "config", "metrics", "logs", "health"):
    NEVER[f"worker.{_module}"] = ["worker.loop", "worker.plan", "worker.gpu", "worker.launch", "worker.fast",
                                  "worker.daemon"]
NEVER["worker.fast_options"] = ["worker", "producer"]  # the fast path's words, which config reads: torch-free, alone


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = modules()


def imports(name: str) -> set[str]:
    """The project's modules that ``name`` imports at run time (lazy imports in functions included)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    typing_only = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", getattr(block.test, "attr", None)) == "TYPE_CHECKING"
                   for node in ast.walk(block)}
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            submodules = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES]
            targets = submodules + ([base] if len(submodules) < len(node.names) else [])  # else: a package's face
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: imports(name) for name in MODULES}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


LINES = {str(path.relative_to(ROOT)): path.read_text().splitlines() for path in MODULES.values()}


def test_no_file_of_the_worker_or_the_producer_is_too_long_to_read_in_one_sitting():
    assert {path: len(lines) for path, lines in LINES.items() if len(lines) > LONGEST} == {}
    assert len(LINES["worker/daemon.py"]) <= WIRING


def carried(source: str) -> set[int]:
    """The lines inside a multi-line string that is no docstring: text the code carries (the function library's
    Lua, pinned by its digest: a change of it is a new revision), not code to wrap."""
    tree = ast.parse(source)
    docstrings = {node.body[0].lineno for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str)}
    out, opened = set(), []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        kind = tokenize.tok_name[token.type]
        if kind == "FSTRING_START":  # Python 3.12 and later: an f-string is several tokens
            opened.append(token.start[0])
        elif kind == "FSTRING_END":
            start = opened.pop()
            if token.end[0] > start and start not in docstrings:
                out.update(range(start + 1, token.end[0]))
        elif kind == "STRING" and token.end[0] > token.start[0] and token.start[0] not in docstrings:
            out.update(range(token.start[0] + 1, token.end[0]))
    return out


def test_lines_are_mostly_within_110_columns():
    wide = set()
    for path, lines in LINES.items():
        skip = carried("\n".join(lines))
        if sum(len(line) > WIDE for n, line in enumerate(lines, 1) if n not in skip) > MOST_WIDE * len(lines):
            wide.add(path)
    assert sorted(wide - WIDE_FOR_NOW) == []
    assert sorted(WIDE_FOR_NOW - wide) == []  # wrapped since: off the list


def test_no_pack_of_assignments_continued_by_a_backslash():
    packed = set()
    for path, lines in LINES.items():
        for node in ast.walk(ast.parse("\n".join(lines))):
            if (isinstance(node, ast.Assign) and any(isinstance(target, ast.Tuple) for target in node.targets)
                    and any(lines[i - 1].rstrip().endswith("\\") for i in range(node.lineno, node.end_lineno))):
                packed.add(path)
    assert sorted(packed - PACKED_FOR_NOW) == []
    assert sorted(PACKED_FOR_NOW - packed) == []  # written plainly since: off the list


def test_no_import_circle():
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(GRAPH[name]):
            if state.get(target) == 1:
                pytest.fail("import circle: " + " -> ".join(path[path.index(target):] + [target]))
            if target not in state:
                visit(target, path + [target])
        state[name] = 2

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [name])


@pytest.mark.parametrize("layer", sorted(NEVER))
def test_no_import_runs_back_up_the_layers(layer):
    bad = [f"{name} imports {target}" for name, targets in sorted(GRAPH.items()) if _under(name, layer)
           for target in sorted(targets) if any(_under(target, never) for never in NEVER[layer])]
    assert bad == []


@pytest.mark.parametrize("layer", sorted(ONLY))
def test_the_contract_and_the_plumbing_import_only_what_is_below_them(layer):
    bad = [f"{name} imports {target}" for name, targets in sorted(GRAPH.items()) if _under(name, layer)
           for target in sorted(targets) if not any(_under(target, allowed) for allowed in ONLY[layer])]
    assert bad == []


def test_every_rule_names_modules_that_exist():
    prefixes = {prefix for rules in (NEVER, ONLY) for layer, named in rules.items() for prefix in (layer, *named)}
    assert sorted(p for p in prefixes if not any(_under(name, p) for name in MODULES)) == []
