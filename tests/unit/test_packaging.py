"""Packaging basics: the version from the package metadata, --version and help on both commands, py.typed, LICENSE."""

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import producer
from producer.cli.main import parser as producer_parser
from producer.gateway.__main__ import parser as gateway_parser
from worker.__main__ import parser as worker_parser

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_file_is_the_apache_2_text_pyproject_declares():
    assert PYPROJECT["project"]["license"] == "Apache-2.0" and PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    for section in ("1. Definitions.", "9. Accepting Warranty or Additional Liability.", "END OF TERMS AND CONDITIONS"):
        assert section in text


def test_both_packages_ship_py_typed():
    for package in ("producer", "worker"):
        assert (ROOT / package / "py.typed").exists()
        assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"][package]


def test_version_comes_from_the_package_metadata():
    assert producer.__version__ == PYPROJECT["project"]["version"]  # the installed metadata, built from pyproject
    copies = [str(path.relative_to(ROOT)) for package in ("producer", "worker", "ops") for path in
              (ROOT / package).rglob("*.py") if f'"{producer.__version__}"' in path.read_text()]
    assert copies == []  # the worker's dq_info metric and both --version read producer.__version__


@pytest.mark.parametrize("package, command", [("producer", "dq-producer"), ("worker", "dq-worker"),
                                              ("producer.gateway", "dq-gateway")])
def test_version_flag_and_documented_entry_points(package, command):
    done = subprocess.run([sys.executable, "-m", package, "--version"], capture_output=True, text=True, timeout=60,
                          cwd=ROOT)
    assert done.returncode == 0 and done.stdout == f"{command} {producer.__version__} (decision-queue, wire " \
                                                   f"protocol v1)\n"
    assert PYPROJECT["project"]["scripts"][command] == f"{package}.__main__:main"
    assert f"`{command}`" in (ROOT / "README.md").read_text()


def _options(parser: argparse.ArgumentParser, path: str = ""):
    """(command path, action) for every flag of a parser and of its subcommands."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{path} {name}")
        elif action.option_strings and not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield path, action


@pytest.mark.parametrize("make", [producer_parser, worker_parser, gateway_parser],
                         ids=["dq-producer", "dq-worker", "dq-gateway"])
def test_every_flag_has_help_showing_its_default_and_no_rst(make):
    top = make()
    flags = list(_options(top))
    assert len(flags) > 10
    for path, action in flags:
        assert action.help and "default" in action.help, (path, action.option_strings)
    texts = [top.format_help()] + [sub.format_help() for action in top._actions
                                   if isinstance(action, argparse._SubParsersAction)
                                   for sub in action.choices.values()]
    assert all("``" not in text for text in texts)
