"""The docs say what the code says: every path a document names exists (``tests/....py::test_name`` a test in its
file, a name ending in ``_`` standing for the tests it begins), docs/CONFIGURATION.md is what the settings write
(ops/configuration.py), each contents list names its document's headings, and each picture is rendered from its
source."""

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


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("name", ["OPERATIONS.md", "RELIABILITY.md", "GATEWAY.md"])
def test_every_contents_entry_names_a_heading_of_its_document(name):
    text = (ROOT / "docs" / name).read_text()
    listed = re.findall(r"^ *- \[([^\]]+)\]\(#([^)]+)\)$", text.split("\n\n", 3)[2], re.M)
    headings = {title: slug(title) for title in re.findall(r"^##+ (.+)$", text, re.M)}
    assert listed, f"{name} has no contents list under its title"
    wrong = [(title, anchor) for title, anchor in listed if headings.get(title) != anchor]
    assert not wrong, f"{name}'s contents name no heading: {wrong}"
    top = [title for title in re.findall(r"^## (.+)$", text, re.M)]
    assert [title for title, _ in listed if title in top] == top, f"{name}'s contents miss a section"


def test_the_pictures_are_rendered_from_their_sources():
    """Each drawing's Graphviz source is in the repository beside its SVG and PNG (bash ops/pictures.sh renders
    them), and the SVG has every node the source names: a node added to a source without rendering it again fails."""
    pictures = ROOT / "docs" / "pictures"
    assert sorted(path.stem for path in pictures.glob("*.dot")) == ["architecture", "deployment"]
    for source in sorted(pictures.glob("*.dot")):
        svg = source.with_suffix(".svg").read_text()
        assert source.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        nodes = re.findall(r"^\s+(\w+) \[label=", source.read_text(), re.M)
        assert nodes and [node for node in nodes if f"<title>{node}</title>" not in svg] == [], source.name
        assert f"pictures/{source.stem}.svg" in (ROOT / "docs" / "OPERATIONS.md").read_text()


def test_every_test_the_bundled_redis_runs_exists_and_says_why():
    """tests/redis/conftest.py ``EVERY_SERVER`` (docs/TESTING.md): a renamed test would silently leave the
    bundled Redis 8 without it."""
    import ast

    source = (ROOT / "tests" / "redis" / "conftest.py").read_text()
    [listed] = [ast.literal_eval(node.value) for node in ast.parse(source).body
                if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == [
                    "EVERY_SERVER"]]
    missing = []
    for entry, why in listed.items():
        module, _, name = entry.partition("::")
        path = ROOT / "tests" / "redis" / f"{module}.py"
        if not path.is_file() or not why or name and not re.search(rf"^def {name}\(", path.read_text(), re.M):
            missing.append(entry)
    assert listed and not missing, f"EVERY_SERVER names tests that do not exist, or no reason: {missing}"
