"""The producer CLI's input and flags refuse what they cannot use, one line or one flag at a time, never with a
traceback (issue: ordinary faults, 9 and 10)."""

import io
import json

import pytest

from producer.cli.main import parser
from producer.cli.submission import read_lines


def test_a_deeply_nested_line_is_refused_alone():
    good = json.dumps({"id": "fine", "state": "x", "questions": {"q": {"type": "noul"}}})
    lines = read_lines(io.StringIO(good + "\n" + "[" * 100_000 + "\n" + good.replace("fine", "fine-2") + "\n"))
    assert [line.id for line in lines] == ["fine", "line 2", "fine-2"]
    assert lines[1].result.error.code.value == "invalid_json" and "deeply" in lines[1].result.error.message


def test_a_negative_limit_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stop:
        parser().parse_args(["submit", "-", "--max-unfinished", "-1"])
    assert stop.value.code == 2 and "must be 0 (no limit) or more" in capsys.readouterr().err
    assert parser().parse_args(["submit", "-", "--max-unfinished", "0"]).max_unfinished == 0
