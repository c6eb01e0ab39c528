"""The decision head and System One answers, shared by every engine.

The head reads the final hidden state at each question's marker row: ``proj`` (a linear layer to the
verbalizer rows), an optional softcap, and the options of a question at rows ``offsets[type] : + options``.
Answers apply the decision config's temperature per type, a softmax, and transformers' ``Question.answer``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.decision import DecisionConfig, Question

from .checkpoint import DecisionModel


def head(model: DecisionModel, hidden: torch.Tensor) -> torch.Tensor:
    """(rows, hidden) final-norm hidden states -> (rows, verbalizers) float32 scores, soft-capped."""
    proj = model.model.proj
    logits = proj(hidden.to(proj.weight.dtype)).float()
    if model.softcap is not None:
        logits = model.softcap * torch.tanh(logits / model.softcap)
    return logits


def option_logits(model: DecisionModel, questions: tuple[Question, ...],
                  scores: torch.Tensor) -> list[list[float]]:
    """The scores of each question's options, in option order, from its prompt's (questions, verbalizers)
    rows."""
    offsets = model.offsets
    rows = scores.tolist()
    return [rows[i][offsets[q.type]: offsets[q.type] + len(q.options)] for i, q in enumerate(questions)]


@dataclass(frozen=True)
class Answer:
    """One question's outcome: raw logits, calibrated probabilities and the System One answer."""

    name: str
    options: list[str]
    logits: list[float]
    probabilities: list[float]
    answer: dict[str, Any]


def softmax(logits: list[float], temperature: float) -> list[float]:
    """In plain Python floats (float64): a few options per question, and no torch call, each of which would
    release and re-take the GIL that the worker's other threads hold in turn."""
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    exps = [math.exp(x - top) for x in scaled]
    total = sum(exps)
    return [e / total for e in exps]


def answer(config: DecisionConfig, question: Question, logits: list[float]) -> Answer:
    probabilities = softmax(logits, float(config.temperature.get(question.type, 1.0)))
    return Answer(question.name, list(question.options), list(logits), probabilities,
                  question.answer(probabilities))
