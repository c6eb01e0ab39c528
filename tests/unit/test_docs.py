"""The docs point at tests that exist: every ``tests/....py`` a document names is a file, and every
``tests/....py::test_name`` a test in it (a name ending in ``_`` stands for the tests it begins)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = re.compile(r"(tests/[\w/]+\.py)(?:::(test_\w+))?")
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


@pytest.mark.parametrize("doc", DOCS, ids=lambda path: path.name)
def test_every_test_a_document_names_exists(doc):
    missing = []
    for path, name in set(REFERENCE.findall(doc.read_text())):
        source = ROOT / path
        if not source.is_file():
            missing.append(path)
        elif name and not re.search(rf"^(async )?def {name}{'' if name.endswith('_') else '(?=[(])'}",
                                    source.read_text(), re.M):
            missing.append(f"{path}::{name}")
    assert not missing, f"{doc.name} names tests that do not exist: {sorted(missing)}"
