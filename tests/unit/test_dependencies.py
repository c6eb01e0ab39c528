"""Every third-party module the packages import is declared in pyproject.toml (the producer's in the base
dependencies: it stays torch-free), and the declared minimums have what the code calls."""

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# Imported only where present, each with a fallback or a clear error: not required by any extra.
OPTIONAL = {"peft",  # merges a JEV checkpoint's LoRA at load, when installed
            "triton", "tilelang", "flash_qla", "fla", "kernels",  # the GPU fast path's kernels (gpu extra, torch)
            "opentelemetry",  # traces, imported only when configured (the otel extra: below)
            "compression"}  # compression.zstd: the stdlib's from Python 3.14 (before it, backports.zstd: http extra)


def declared(*groups: str) -> dict[str, str]:
    """Normalized distribution name -> its requirement, from the base dependencies and the named extras."""
    requirements = list(PROJECT["dependencies"])
    for group in groups:
        requirements += PROJECT["optional-dependencies"][group]
    return {re.split(r"[<>=!~\[ ]", r, maxsplit=1)[0].lower().replace("_", "-"): r for r in requirements}


def imported(package: str, leave_out: str | None = None) -> set[str]:
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        if leave_out and (ROOT / package / leave_out) in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"producer", "worker", "__future__"}


def missing(package: str, *groups: str, leave_out: str | None = None) -> list[str]:
    have, distributions = declared(*groups), packages_distributions()
    out = []
    for module in sorted(imported(package, leave_out) - OPTIONAL):
        names = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        if not names & set(have):
            out.append(module)
    return out


def test_the_producer_imports_only_its_base_dependencies():
    assert missing("producer", leave_out="gateway") == []


def test_the_gateway_declares_what_it_imports_in_the_http_extra():
    assert missing("producer", "http") == []


def test_the_worker_declares_what_it_imports():
    assert missing("worker", "worker", "gpu") == []


def test_traces_import_only_what_the_otel_extra_declares():
    """OpenTelemetry's modules come from the otel extra's two distributions (and the API they depend on)."""
    code = "".join(p.read_text() for package in ("producer", "worker") for p in (ROOT / package).rglob("*.py"))
    used = set(re.findall(r"(?:from|import) (opentelemetry(?:\.\w+)+)", code))
    assert used and {"opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http"} <= set(declared("otel"))
    distributions = packages_distributions()
    for module in used:  # each resolves to the SDK, the exporter or the API both bring
        assert module.startswith(("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http", "opentelemetry.trace",
                                  "opentelemetry.context")), module
    assert "opentelemetry-api" in {d.lower() for d in distributions.get("opentelemetry", [])}


def test_declared_minimums_have_what_the_code_calls():
    code = "".join(p.read_text() for package in ("producer", "worker") for p in (ROOT / package).rglob("*.py"))
    assert "aclose()" in code  # redis-py 5.0.0's asyncio client has no aclose: 5.0.1 added it
    minimum = re.search(r">=([0-9.]+)", declared()["redis"]).group(1)
    assert tuple(map(int, minimum.split("."))) >= (5, 0, 1), minimum
