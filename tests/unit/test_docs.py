"""The docs say what the code says: every path a document names exists (``tests/....py::test_name`` a test in its
file, a name ending in ``_`` standing for the tests it begins), and docs/CONFIGURATION.md is what the settings
write (ops/configuration.py)."""

import re
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEST = re.compile(r"(tests/[\w/]+\.py)(?:::(test_\w+))?")
# A path of this repository: a top folder, then names (a glob or a placeholder is not a path).
PATH = re.compile(r"(?<![\w./-])((?:worker|producer|ops|docs|examples|tests)/[\w./-]*\w)(?![\w*{<])")
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_every_test_a_document_names_exists(doc):
    missing = []
    for path, name in set(TEST.findall(doc.read_text())):
        source = ROOT / path
        if not source.is_file():
            missing.append(path)
        elif name and not re.search(rf"^(async )?def {name}{'' if name.endswith('_') else '(?=[(])'}",
                                    source.read_text(), re.M):
            missing.append(f"{path}::{name}")
    assert not missing, f"{doc.name} names tests that do not exist: {sorted(missing)}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_every_path_a_document_names_exists(doc):
    """Files moved in the layout change (issue 33) took their docs' references with them; this keeps it so."""
    missing = sorted({path for path in PATH.findall(doc.read_text()) if not (ROOT / path).exists()})
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_the_configuration_doc_is_what_the_settings_write():
    render = runpy.run_path(str(ROOT / "ops" / "configuration.py"))["render"]
    assert (ROOT / "docs" / "CONFIGURATION.md").read_text() == render(), "run python ops/configuration.py"
