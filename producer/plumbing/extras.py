"""The optional parts a command needs (pyproject.toml's extras: ``http`` for dq-gateway, ``worker`` for
dq-worker's serve, tiny-checkpoint and check). A command started without its extra says which to install and
exits 2 (usage), where it ended in a ModuleNotFoundError's traceback naming a module of the extra and not the
extra; ``--help`` and ``--version`` need no extra.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from .exits import USAGE

# Each extra's top-level modules (pyproject.toml's optional dependencies, as imported): a module missing from
# this list is no missing extra but a broken install, and its error is left as it is.
MODULES = {
    "http": frozenset({"fastapi", "starlette", "uvicorn", "prometheus_client", "uvloop", "httptools", "multipart",
                       "python_multipart", "backports", "fastapi_offline"}),
    "worker": frozenset({"torch", "transformers", "prometheus_client", "PIL", "safetensors", "hiredis", "numpy",
                         "jinja2", "tokenizers"}),
}


def advice(extra: str) -> str:
    return f"pip install 'decision-queue[{extra}]' (from a checkout: pip install -e '.[{extra}]')"


@contextmanager
def needed(extra: str, command: str) -> Iterator[None]:
    """Run the block (the command's imports); a module of ``extra`` missing in it: say which extra to install
    and exit 2."""
    try:
        yield
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] not in MODULES[extra]:
            raise
        print(f"{command}: needs the {extra} extra, not installed here (no module {error.name!r}): "
              f"{advice(extra)}", file=sys.stderr)
        raise SystemExit(USAGE) from None


def require(module: str) -> None:
    """ModuleNotFoundError unless ``module`` can be imported, without importing it (a process that only starts
    others that will)."""
    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)
