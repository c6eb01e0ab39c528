"""What ``dq-producer submit`` tracks: each input line and what became of it, and the report on stderr.

A line is read, then refused (bad JSON or schema), queued or not sent (the queue stayed full); once queued, answered
or timed out. Every line ends with one result: the worker's, or one made here saying why there is none.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, BinaryIO, TextIO

from ..client.plans import InvalidRequest, Prepared, prepare
from ..plumbing.exits import FAILED, INTERRUPTED, OK, QUEUE_FULL
from ..wire.keys import valid_id
from ..wire.result import Result
from ..wire.schema import ErrorCode

FINAL = ("refused", "answered", "timed_out", "not_sent")


@dataclass(eq=False)
class Line:
    """One non-empty input line and what became of it: read, then refused, queued or not sent; once queued,
    answered or timed out. ``result``: the worker's, or one made here for a line that got none."""

    number: int
    prepared: Prepared | None = None
    result: Result | None = None
    state: str = "read"

    @property
    def id(self) -> str:
        return self.prepared.id if self.prepared is not None else self.result.id

    @classmethod
    def refused(cls, number: int, request_id: str, code: ErrorCode, message: str) -> Line:
        return cls(number, result=Result.failure(request_id, code, f"line {number}: {message}"), state="refused")

    @property
    def error_code(self) -> ErrorCode | str | None:
        """The code of its error result (refused here or answered so by a worker); None while it has none."""
        return self.result.error.code if self.result is not None and self.result.error is not None else None

    def fail(self, state: str, code: ErrorCode, message: str) -> None:
        self.state, self.result = state, Result.failure(self.id, code, f"line {self.number}: {message}")

    def receipt(self) -> dict[str, Any]:
        """What ``submit`` without ``--wait`` prints: the line, its id, and why it was not queued."""
        out: dict[str, Any] = {"line": self.number, "id": self.id}
        if self.state != "queued" and self.result is not None and self.result.error is not None:
            out["error"] = self.result.error.model_dump(mode="json")
        return out


def read_lines(handle: BinaryIO | TextIO, priority: str | None = None) -> list[Line]:
    """One ``Line`` per non-empty input line, its request prepared (given or generated id) or refused.
    ``priority``: the lane of requests whose line does not say. Bytes are decoded line by line, so one line that
    is not UTF-8 is refused alone, by its number."""
    lines = []
    for number, raw in enumerate(handle, 1):
        # A refused line without a usable id of its own is named "line N": the space is outside the id charset,
        # so the name can never be another line's real id.
        placeholder = f"line {number}"
        try:
            text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError as error:
            lines.append(Line.refused(number, placeholder, ErrorCode.INVALID_JSON,
                                      f"not UTF-8 (byte {error.start + 1} of the line)"))
            continue
        if not text.strip():
            continue
        try:
            data = json.loads(text)
        except ValueError as error:
            lines.append(Line.refused(number, placeholder, ErrorCode.INVALID_JSON, f"not JSON: {error}"))
            continue
        except RecursionError:  # not a ValueError: it once ended the command with a traceback
            lines.append(Line.refused(number, placeholder, ErrorCode.INVALID_JSON, "nested too deeply"))
            continue
        if not isinstance(data, dict):
            lines.append(Line.refused(number, placeholder, ErrorCode.INVALID_JSON,
                                      f"a request is a JSON object, got {type(data).__name__}"))
            continue
        if priority is not None:
            data.setdefault("priority", priority)
        try:
            lines.append(Line(number, prepare(data)))
        except InvalidRequest as error:
            given = data.get("id")
            request_id = given if isinstance(given, str) and valid_id(given) else placeholder
            lines.append(Line.refused(number, request_id, ErrorCode.INVALID_REQUEST, str(error)))
    return lines


class Report:
    """The progress line, notes and the summary on stderr; what goes out on stdout or --out."""

    NOTES = 20  # refusals named one by one; the rest are counted (the output names them all)

    def __init__(self, lines: list[Line], out: TextIO, quiet: bool) -> None:
        self.lines, self.out, self.quiet = lines, out, quiet
        self.tty = sys.stderr.isatty()
        self.shown = self.start = time.monotonic()
        self.waiting_since: float | None = None  # set when the results are awaited
        self.next = 0  # --ordered: the first line not written yet
        self.written: set[int] = set()  # the numbers of the lines whose result is out (unordered)
        self.sending: list[Line] = []  # the window of the submit call in progress: in doubt if it is interrupted

    def count(self, *states: str) -> int:
        return sum(line.state in states for line in self.lines)

    def progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.quiet or (not force and now - self.shown < (0.5 if self.tty else 10.0)):
            return
        self.shown = now
        queued = self.count("queued", "answered", "timed_out")
        text = f"queued {queued}/{len(self.lines)}"
        if self.waiting_since is not None:
            answered = self.count("answered")
            text += f"  answered {answered}/{queued}  {answered / max(now - self.waiting_since, 1e-9):.1f}/s"
        self.note(text, redraw=True)

    def note(self, text: str, redraw: bool = False) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K" + text + ("" if redraw else "\n"))
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def refusals(self) -> None:
        refused = [line for line in self.lines if line.state == "refused"]
        for line in refused[: self.NOTES]:
            self.note(line.result.error.message)
        if len(refused) > self.NOTES:
            self.note(f"... and {len(refused) - self.NOTES} more refused lines")

    def write(self, line: Line, ordered: bool) -> None:
        """Write one line's result (when it has one): at once, or in input order as the prefix completes."""
        if not ordered:
            self.out.write(line.result.model_dump_json(exclude_none=True) + "\n")
            self.written.add(line.number)
            return
        while self.next < len(self.lines) and self.lines[self.next].state in FINAL:
            done = self.lines[self.next]
            self.out.write(done.result.model_dump_json(exclude_none=True) + "\n")
            self.next += 1

    def interrupted(self, waited: bool, ordered: bool) -> int:
        """Ctrl-C: every line still gets its record, so what went in can be found by its id; the summary; 130."""
        for line in self.lines:
            if line.state == "read":
                line.fail("not_sent", ErrorCode.NOT_SENT,
                          f"interrupted while being sent: it may be queued (dq-producer result {line.id})"
                          if line in self.sending else "interrupted before it was sent")
            elif line.state == "queued" and waited:
                line.fail("timed_out", ErrorCode.TIMEOUT, f"interrupted before its result came; the request stays "
                                                          f"queued (dq-producer result {line.id})")
        for line in self.lines:
            if not waited:
                self.out.write(json.dumps(line.receipt()) + "\n")
            elif ordered or line.number not in self.written:
                self.write(line, ordered)
        self.note("dq-producer: interrupted")
        self.summary(waited)
        return INTERRUPTED

    def summary(self, waited: bool) -> int:
        """The last stderr line, and the exit code it stands for."""
        failed = Counter(line.error_code for line in self.lines
                         if line.state in ("refused", "answered") and line.error_code is not None)
        if waited:
            parts = [f"{self.count('answered') - sum(failed.values()) + self.count('refused')} ok"]
        else:
            parts = [f"{self.count('queued')} queued"]
        if failed:
            total = sum(failed.values())
            what = ("error" if total == 1 else "errors") if waited else "refused"
            parts.append(f"{total} {what} ({', '.join(f'{_code(code)} {n}' for code, n in failed.most_common())})")
        for state, words in (("timed_out", "timed out"), ("not_sent", "not sent")):
            if self.count(state):
                parts.append(f"{self.count(state)} {words}")
        self.note(f"{len(self.lines)} requests: " + ", ".join(parts))
        if self.count("not_sent"):
            return QUEUE_FULL
        return FAILED if failed or self.count("timed_out") else OK


def _code(code: ErrorCode | str) -> str:
    return code.value if isinstance(code, ErrorCode) else code
