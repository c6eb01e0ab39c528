"""Which models are served, and where: read from the live workers' heartbeats, one namespace after another.

A namespace is one model's queue: its workers load one checkpoint and serve it under its names (``dq-worker
serve --served-model-name``, default the checkpoint's own name; the first is the one results say, the others
are aliases). Several models on one Redis are several namespaces, each with its own workers, lanes and
scaling. A caller that names a model (``Client(model=...)``, ``dq-producer --model``, the gateway's ``POST
/v1/systemone``) is routed to the first of the namespaces it may use whose live workers serve that name; a
name nobody serves is refused at once (``ModelNotServed``, naming the served ones), never queued to wait for a
worker that will not come.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ..plumbing.commands import command
from ..wire.errors import ModelNotServed
from ..wire.keys import Keys, beat_live, beat_models
from .plans import Plan

T = TypeVar("T")


@dataclass(frozen=True)
class ServedModel:
    """A model live workers serve: ``name`` (what its results say), the ``namespace`` its requests go to,
    every name it answers to (``names``, ``name`` first) and how many live workers serve it."""

    name: str
    namespace: str
    names: tuple[str, ...]
    workers: int


def catalog(beats: Mapping[bytes | str, bytes | str], namespace: str, now: float) -> dict[str, ServedModel]:
    """One namespace's served models by each of their names, from its heartbeat hash (``HGETALL
    Keys.workers``): the live workers', those warming up included, a draining one's not (it reads no more). A
    name that is one worker's first and another's alias belongs to the first (the name its results say)."""
    counts: dict[str, int] = {}
    names: dict[str, tuple[str, ...]] = {}
    for raw in beats.values():
        served = beat_models(raw)
        if served and beat_live(raw, now) and not draining(raw):
            counts[served[0]] = counts.get(served[0], 0) + 1
            names[served[0]] = tuple(dict.fromkeys(names.get(served[0], ()) + served))
    models = {first: ServedModel(first, namespace, names[first], count) for first, count in counts.items()}
    out: dict[str, ServedModel] = {}
    for model in sorted(models.values(), key=lambda m: m.name):
        for name in model.names[1:]:
            out.setdefault(name, model)
    out.update(models)  # a first name wins over an alias
    return out


def draining(raw: Any) -> bool:
    try:
        return json.loads(raw).get("state") == "draining"
    except (ValueError, TypeError, AttributeError):
        return False


def served(namespaces: Iterable[str]) -> Plan[dict[str, ServedModel]]:
    """The models served in ``namespaces`` by each of their names; a name served in several is the first
    namespace's."""
    out: dict[str, ServedModel] = {}
    for namespace in namespaces:
        beats = yield command("HGETALL", Keys(namespace).workers())
        for name, model in catalog(beats, namespace, time.time()).items():
            out.setdefault(name, model)
    return out


def route(model: str, namespaces: list[str]) -> Plan[ServedModel]:
    """The served model ``model`` names in ``namespaces``; raises ModelNotServed."""
    found = yield from served(namespaces)
    if model not in found:
        raise ModelNotServed(model, found, namespaces)
    return found[model]


def routing(face: Any, plan: Plan[T]) -> Plan[T]:
    """``plan`` of a client (producer/client/faces.py) made for a model, run once the model's namespace is
    found: at its first call, or at the next one after a ModelNotServed. Plans read their core's keys when
    they run (not when they are made), so ``plan`` goes to that namespace too."""
    if face.model is not None and face.routed is None:
        face.routed = yield from route(face.model, face.model_namespaces)
        face.keys = face.core.keys = Keys(face.routed.namespace)
    return (yield from plan)
