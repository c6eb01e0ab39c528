"""What a plan of the producer's core (plans.py) yields for a face to send (runner.py): one Redis exchange
each, a plain object with no socket. The face sends it and hands the reply back, or throws the error in.

A step is a command of the plumbing's one shape or a ``Pipeline`` of them (producer/plumbing/commands.py), a
``Durable`` batch (producer/plumbing/durable.py: its reply a ``Confirmed``), or a ``Load`` of the function
library.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from ..plumbing.commands import Command, Pipeline
from ..plumbing.durable import Durable

T = TypeVar("T")


@dataclass(frozen=True)
class Load:
    """Load the function library if the server has none (producer/plumbing/library_loader.py): the reply is a
    ``library.Loaded``, or ``library.LibraryUnavailable`` is thrown in."""


Step = Command | Pipeline | Durable | Load
Plan = Generator[Step, Any, T]
