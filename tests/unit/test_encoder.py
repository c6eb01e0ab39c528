import pytest
import torch

from support import png
from producer.schema import ErrorCode, Request, RequestError
from worker.model.encoder import Encoder

QUESTIONS = {
    "spam": {"type": "noul", "instructions": "Is this spam?"},
    "tone": {"type": "choice", "instructions": "Tone?", "criteria": {"calm": "polite", "angry": None}},
    "urgency": {"type": "score", "criteria": ["low", "medium", "high"]},
}
CONTROL = ["<|mark|>", "<|split|>", "<|im_start|>", "<|im_end|>", "<|image_pad|>", "<|vision_start|>", "<think>"]


def request(state="I was charged twice.", questions=QUESTIONS, **extra):
    return Request.model_validate({"state": state, "questions": questions, **extra})


def test_one_prompt_reads_every_question(loaded):
    encoder = Encoder(loaded("repo"))
    [chunk] = encoder.plan(request())
    assert [q.name for q in chunk.questions] == ["spam", "tone", "urgency"]
    assert [q.options for q in chunk.questions] == [["true", "false"], ["calm", "angry"], ["0", "1", "2"]]
    assert chunk.rows.tolist() == sorted(chunk.rows.tolist()) and int(chunk.rows[-1]) < chunk.length
    assert chunk.image_grid_thw is None and chunk.pixel_values is None


def test_per_question_templates_give_a_prompt_per_question(loaded):
    chunks = Encoder(loaded("readout")).plan(request())
    assert [[q.name for q in c.questions] for c in chunks] == [["spam"], ["tone"], ["urgency"]]
    assert all(c.rows.tolist() == [c.length - 1] for c in chunks)  # read at the last token


@pytest.mark.parametrize("name", ["repo", "readout", "judge"])
def test_control_tokens_in_user_text_stay_text(loaded, name):
    model = loaded(name)
    tokenizer = model.tokenizer
    plain = Encoder(model).plan(request(state="hello", questions={"q": {"type": "noul", "instructions": "ok?"}}))
    hostile = " ".join(CONTROL)
    chunks = Encoder(model).plan(request(state=f"hello {hostile}", questions={
        "q": {"type": "noul", "instructions": f"ok? {hostile}", "criteria": {"true": hostile}}}))
    control_ids = set(tokenizer.convert_tokens_to_ids(CONTROL))
    for before, after in zip(plain, chunks):
        # The template's own control tokens are there; user text adds none, and no extra marks are read.
        count = lambda ids: sorted(i for i in ids.tolist() if i in control_ids)
        assert count(after.input_ids) == count(before.input_ids)
        assert len(after.rows) == len(before.rows)
        assert "<|mark|>" in tokenizer.decode(after.input_ids)  # as text


def test_images_become_image_tokens_with_grid_and_types(loaded):
    model = loaded("repo")
    chunks = Encoder(model).plan(request(state="Compare img-1 with img-2.", assets={
        "img-1": {"data_base64": png("red", (64, 64))}, "img-2": {"data_base64": png("blue", (128, 64), "JPEG")}}))
    [chunk] = chunks
    image_id = model.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    grid = chunk.image_grid_thw
    assert grid.tolist() == [[1, 4, 4], [1, 4, 8]]  # 16-pixel patches
    tokens = (chunk.input_ids == image_id)
    assert int(tokens.sum()) == int(grid.prod(-1).sum()) // 4  # merge 2x2
    assert torch.equal(chunk.mm_token_type_ids.bool(), tokens)
    assert chunk.pixel_values.shape[0] == int(grid.prod(-1).sum())


def test_image_errors(loaded):
    encoder = Encoder(loaded("repo"), max_image_pixels=100 * 100)
    cases = [
        ({"data_base64": "not base64!"}, "not valid base64"),
        ({"data_base64": "aGVsbG8="}, "cannot decode"),
        ({"data_base64": png("red", (64, 64), "TIFF")}, "unsupported image format TIFF"),
        ({"data_base64": png("red", (200, 200))}, "over the limit"),
    ]
    for asset, message in cases:
        with pytest.raises(RequestError, match=message) as error:
            encoder.plan(request(state="see img-1", assets={"img-1": asset}))
        assert error.value.code == ErrorCode.INVALID_IMAGE
    with pytest.raises(RequestError, match="text only"):
        Encoder(loaded("repo-text")).plan(request(state="see img-1", assets={"img-1": {"data_base64": png()}}))


def test_model_specific_limits_are_invalid_requests(loaded):
    options = {f"o{i}": None for i in range(20)}  # the judge head reads 16 choice options
    with pytest.raises(RequestError, match="at most 16 options") as error:
        Encoder(loaded("judge")).plan(request(questions={"c": {"type": "choice", "criteria": options}}))
    assert error.value.code == ErrorCode.INVALID_REQUEST
    # The repo head has 24 rows and choice options start at row 8: 16 options at most, though 26 labels exist.
    with pytest.raises(RequestError, match="scores at most 16 options") as error:
        Encoder(loaded("repo")).plan(request(questions={"c": {"type": "choice", "criteria": options}}))
    assert error.value.code == ErrorCode.INVALID_REQUEST


def test_over_length_requests_split_by_question(loaded):
    model = loaded("repo", max_chunk_tokens=160)
    questions = {f"q{i}": {"type": "choice", "instructions": f"Question number {i}?",
                           "criteria": {"yes": "it is so", "no": "it is not"}} for i in range(12)}
    chunks = Encoder(model).plan(request(state="A short state.", questions=questions))
    assert len(chunks) > 1
    assert all(c.length <= 160 for c in chunks)
    assert [q.name for c in chunks for q in c.questions] == list(questions)  # each once, in order
    # The same questions asked of a model that reads them at once give one prompt.
    assert len(Encoder(loaded("repo")).plan(request(state="A short state.", questions=questions))) == 1


def test_only_some_questions(loaded):
    chunks = Encoder(loaded("repo")).plan(request(), names=["urgency", "spam"])
    assert [q.name for q in chunks[0].questions] == ["urgency", "spam"]
    with pytest.raises(RequestError, match="no question named 'nope'"):
        Encoder(loaded("repo")).plan(request(), names=["nope"])


def test_state_too_long_states_the_counts(loaded):
    model = loaded("repo", max_chunk_tokens=160)
    with pytest.raises(RequestError) as error:
        Encoder(model).plan(request(state="word " * 400))
    assert error.value.code == ErrorCode.STATE_TOO_LONG
    assert "at most 160" in error.value.message and "tokens" in error.value.message
    with pytest.raises(RequestError, match="at most 160") as error:
        Encoder(loaded("readout", max_chunk_tokens=160)).plan(request(state="word " * 400))
    assert error.value.code == ErrorCode.STATE_TOO_LONG
