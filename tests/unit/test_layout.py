"""The layout shows the architecture, and keeps showing it: no import circle, no import that runs back up the
layers (the wire contract <- the worker's stages <- the model contract <- the fast engine), each thread's stages in
a folder of their own that imports no other thread's, and files readable in one sitting (README, "Layout")."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("producer", "worker")
LONGEST = 300  # lines of any file of worker/ or producer/
WIRING = 250  # worker/daemon.py: the stages wired together, nothing else

# module prefix -> prefixes of this project it must never import (at run time: a TYPE_CHECKING import only names
# a type). A prefix covers the module and everything under it.
NEVER = {
    "producer": ["worker"],  # torch-free, and below every worker
    "producer.wire": ["producer.client", "producer.plans", "producer.admin", "producer.gateway", "producer.local",
                      "producer.__main__", "producer.submission", "producer.exits", "producer.arrivals",
                      "producer.stats"],  # the contract imports only itself
    "producer.local": ["producer.client", "producer.plans", "producer.admin", "producer.gateway"],
    "worker": ["producer.client", "producer.plans", "producer.admin", "producer.gateway", "producer.local",
               "producer.__main__", "producer.submission"],  # a worker speaks the wire, not the client
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


def test_no_file_of_the_worker_or_the_producer_is_too_long_to_read_in_one_sitting():
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in MODULES.values()}
    assert {path: n for path, n in lengths.items() if n > LONGEST} == {}
    assert lengths["worker/daemon.py"] <= WIRING


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
    bad = [f"{name} imports {target}" for name, targets in sorted(GRAPH.items())
           if name == layer or name.startswith(layer + ".")
           for target in sorted(targets)
           if any(target == never or target.startswith(never + ".") for never in NEVER[layer])]
    assert bad == []
