"""The batched, padded reference engine equals transformers' own per-prompt JevForDecision forward."""

import base64
import io

import pytest
import torch
from PIL import Image
from transformers.decision import prepare_inputs

from producer.wire.schema import Request
from support import png
from worker.model.encoder import Encoder
from worker.model.readout import answer, option_logits
from worker.model.reference import ReferenceEngine

MIXED = {
    "spam": {"type": "noul", "instructions": "Is this spam?"},
    "tone": {"type": "choice", "criteria": {"calm": "polite", "angry": None, "pushy": "pressure"}},
    "urgency": {"type": "score", "instructions": "How urgent?", "criteria": ["low", "medium", "high", "now"]},
}


def requests(multimodal):
    out = [Request.model_validate({"state": "I was charged twice. " * k, "questions": MIXED}) for k in (1, 4, 8)]
    out.append(Request.model_validate({"state": {"message": "WIN a FREE phone"}, "questions": {
        "spam": MIXED["spam"]}}))
    if multimodal:
        out.append(Request.model_validate({
            "state": "Look: img-1, then img-2.", "questions": MIXED,
            "assets": {"img-1": {"data_base64": png("red", (64, 64))},
                       "img-2": {"data_base64": png("blue", (96, 32))}}}))
    return out


def transformers_scores(model, request):
    """What transformers computes, one prompt at a time: temperature-scaled option scores per question."""
    body = request.template_input()
    if request.assets:
        body["assets"] = {n: Image.open(io.BytesIO(base64.b64decode(a.data_base64))).convert("RGB")
                          for n, a in request.assets.items()}
    out = {}
    for inputs, questions in prepare_inputs(model.decision_config, body, model.processor):
        scores = model.model.decide(**inputs, decision_questions=questions)
        out.update({q.name: s.tolist() for q, s in zip(questions, scores)})
    return out


@pytest.mark.parametrize("name, max_tokens", [("repo", None), ("repo", 140), ("repo-text", None),
                                              ("readout", None), ("readout-text", None), ("judge", None)])
def test_reference_equals_transformers(loaded, name, max_tokens):
    model = loaded(name, max_tokens)
    encoder, engine = Encoder(model), ReferenceEngine(model)
    batch, owners = [], []
    for index, request in enumerate(requests(model.multimodal)):
        prompts = encoder.prompts(request)
        batch += prompts
        owners += [index] * len(prompts)
    if max_tokens:
        assert len(batch) > len(set(owners))  # some requests were split over several prompts
    scores = engine.forward(batch)  # every request's prompts in one padded batch
    listed = requests(model.multimodal)
    for owner, prompt, rows in zip(owners, batch, scores):
        # transformers on the same prompt: the request restricted to this prompt's questions
        names = [q.name for q in prompt.questions]
        subset = listed[owner].model_copy(update={"questions": {n: listed[owner].questions[n] for n in names}})
        expected = transformers_scores(model, subset)
        assert list(expected) == names
        for question, logits in zip(prompt.questions, option_logits(model, prompt.questions, rows)):
            temperature = model.decision_config.temperature.get(question.type, 1.0)
            got = torch.tensor([x / temperature for x in logits])
            assert torch.allclose(got, torch.tensor(expected[question.name]), atol=1e-4), question.name


def test_answers_match_the_pipeline(tiny_dir, loaded):
    from transformers import pipeline

    model = loaded("repo")
    request = Request.model_validate({"state": "Refund please, it broke.", "questions": MIXED})
    [prompt] = Encoder(model).prompts(request)
    [rows] = ReferenceEngine(model).forward([prompt])
    answers = {q.name: answer(model.decision_config, q, logits)
               for q, logits in zip(prompt.questions, option_logits(model, prompt.questions, rows))}
    expected = pipeline("decision", model=str(tiny_dir))(request.template_input())
    assert answers["spam"].answer["noul"] == pytest.approx(expected["spam"]["noul"], abs=1e-5)
    assert answers["tone"].answer["choice"] == expected["tone"]["choice"]
    assert answers["tone"].answer["confidence"] == pytest.approx(expected["tone"]["confidence"], abs=1e-5)
    assert answers["urgency"].answer["score"] == pytest.approx(expected["urgency"]["score"], abs=1e-5)
    assert sum(answers["urgency"].probabilities) == pytest.approx(1.0)
    assert answers["tone"].options == ["calm", "angry", "pushy"]


@pytest.mark.parametrize("temperature", [0.25, 1.0, 3.0])
def test_readout_softmax_equals_torch(temperature):
    """The read-out's plain-Python softmax is torch's float64 softmax, also for logits far from zero."""
    from worker.model.readout import softmax

    generator = torch.Generator().manual_seed(0)
    for options in (2, 4, 5, 16):
        for spread in (1.0, 50.0, 800.0):
            logits = (torch.randn(options, generator=generator, dtype=torch.float64) * spread).tolist()
            expected = torch.softmax(torch.tensor(logits, dtype=torch.float64) / temperature, dim=-1).tolist()
            assert softmax(logits, temperature) == pytest.approx(expected, abs=1e-12)


def test_epilogues_chosen_for_the_reference_engine_are_said_not_applied_once_at_start(loaded, caplog):
    """They are kernels of the fast engine: a worker on the reference engine once dropped the flag in silence. The
    default, which names the fast engine's kernels whatever runs, is not worth a line."""
    from worker.config import Settings
    from worker.model.reference import ReferenceAdapter

    model = loaded("repo-text")
    with caplog.at_level("INFO", logger="worker"):
        ReferenceAdapter(model, Settings())
        ReferenceAdapter(model, Settings(epilogues="none"))
        assert "epilogues" not in caplog.text
        ReferenceAdapter(model, Settings(epilogues="gated_norm"))
    lines = [record.getMessage() for record in caplog.records if "epilogues" in record.getMessage()]
    assert lines == ["--epilogues gated_norm not applied: the reference engine runs the checkpoint's own modules "
                     "(the epilogues are kernels of the fast engine)"]
