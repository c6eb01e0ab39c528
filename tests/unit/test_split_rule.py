"""Only what cannot run whole is split: a request's prompt is split by question when it is longer than the model's
context, or than ``--max-prompt-tokens`` where the operator set one (by default none), and the prompts say so
(``Prompt.split``, for the result's ``usage.split``), across planner processes too."""

import json

import pytest

from producer.wire.schema import Request

from producer.wire.result import Usage
from worker.config import Settings
from worker.entries import REQUESTS, Delivery
from worker.model.encoder import Encoder
from worker.plan.planner import Planner

CONTEXT = 4096  # the tiny checkpoint's max_position_embeddings


def delivery(body: bytes) -> Delivery:
    return Delivery.parse(REQUESTS, "key", "1-0", {b"body": body}, 1)


def request(questions: int, instructions: str = "Is it so?") -> Request:
    return Request.model_validate({"id": "s-1", "state": "A short state.", "questions": {
        f"q{i}": {"type": "choice", "instructions": f"{instructions} ({i})",
                  "criteria": {"yes": "it is so", "no": "it is not"}} for i in range(questions)}})


def test_by_default_the_limit_is_the_models_context(loaded):
    assert Settings().max_prompt_tokens == 0
    assert loaded("repo", max_prompt_tokens=Settings().max_prompt_tokens).max_length == CONTEXT
    assert loaded("repo", max_prompt_tokens=160).max_length == 160  # the operator's choice, when smaller


def test_a_request_that_fits_the_context_runs_whole_whatever_its_length(loaded):
    encoder = Encoder(loaded("repo"))
    [prompt] = encoder.prompts(request(12, "Read the state again and weigh every detail of it " * 5))
    assert 2000 < prompt.length <= CONTEXT  # far past a fixed 1-2k limit, inside the context: one prompt
    assert not prompt.split and len(prompt.questions) == 12


def test_over_the_context_a_request_is_split_by_question_and_says_so(loaded):
    encoder = Encoder(loaded("repo"))
    long = request(12, "Read the state again and weigh every detail of it " * 20)  # about 8k tokens
    prompts = encoder.prompts(long)
    assert len(prompts) > 1 and all(prompt.length <= CONTEXT for prompt in prompts)
    assert all(prompt.split for prompt in prompts)
    assert [q.name for prompt in prompts for q in prompt.questions] == list(long.questions)  # each once, in order


def test_over_the_operators_limit_a_request_is_split(loaded):
    prompts = Encoder(loaded("repo", max_prompt_tokens=160)).prompts(request(12))
    assert len(prompts) > 1 and all(prompt.split and prompt.length <= 160 for prompt in prompts)


def test_a_part_holding_some_questions_is_split_and_one_holding_all_is_not(loaded):
    encoder = Encoder(loaded("repo"))
    whole = request(4)
    assert all(prompt.split for prompt in encoder.prompts(whole, ["q1", "q2"]))
    assert not any(prompt.split for prompt in encoder.prompts(whole, list(whole.questions)))


@pytest.mark.parametrize("processes", [0, 1])
def test_the_planner_hands_the_split_on(loaded, processes):
    planner = Planner(loaded("repo", max_prompt_tokens=160), Settings(planner_processes=processes))
    try:
        body = json.dumps(request(12).model_dump(exclude_none=True)).encode()
        task = planner.submit(delivery(body)).result(timeout=120)
        assert len(task.prompts) > 1 and all(prompt.split for prompt in task.prompts)
        body = json.dumps(request(2).model_dump(exclude_none=True)).encode()
        task = planner.submit(delivery(body)).result(timeout=120)
        assert [prompt.split for prompt in task.prompts] == [False]
    finally:
        planner.shutdown()


def test_the_result_field_is_absent_unless_set():
    assert "split" not in Usage().model_dump(exclude_none=True)
    assert Usage.model_validate({"split": True}).split is True
