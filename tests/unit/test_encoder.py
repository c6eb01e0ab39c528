import copy

import pytest
import torch
from PIL import Image
from transformers.decision import prepare_inputs

from producer.wire.schema import ErrorCode, Request, RequestError
from support import png
from worker.model.encoder import CHARS_PER_TOKEN, Encoder, fewest_tokens, printed

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
    [prompt] = encoder.prompts(request())
    assert [q.name for q in prompt.questions] == ["spam", "tone", "urgency"]
    assert [q.options for q in prompt.questions] == [["true", "false"], ["calm", "angry"], ["0", "1", "2"]]
    assert prompt.rows.tolist() == sorted(prompt.rows.tolist()) and int(prompt.rows[-1]) < prompt.length
    assert prompt.image_grid_thw is None and prompt.pixel_values is None


def test_per_question_templates_give_a_prompt_per_question(loaded):
    prompts = Encoder(loaded("readout")).prompts(request())
    assert [[q.name for q in c.questions] for c in prompts] == [["spam"], ["tone"], ["urgency"]]
    assert all(c.rows.tolist() == [c.length - 1] for c in prompts)  # read at the last token


@pytest.mark.parametrize("name", ["repo", "readout", "judge"])
def test_control_tokens_in_user_text_stay_text(loaded, name):
    model = loaded(name)
    tokenizer = model.tokenizer
    plain = Encoder(model).prompts(request(state="hello", questions={"q": {"type": "noul", "instructions": "ok?"}}))
    hostile = " ".join(CONTROL)
    prompts = Encoder(model).prompts(request(state=f"hello {hostile}", questions={
        "q": {"type": "noul", "instructions": f"ok? {hostile}", "criteria": {"true": hostile}}}))
    control_ids = set(tokenizer.convert_tokens_to_ids(CONTROL))
    for before, after in zip(plain, prompts):
        # The template's own control tokens are there; user text adds none, and no extra marks are read.
        count = lambda ids: sorted(i for i in ids.tolist() if i in control_ids)
        assert count(after.input_ids) == count(before.input_ids)
        assert len(after.rows) == len(before.rows)
        assert "<|mark|>" in tokenizer.decode(after.input_ids)  # as text


def test_images_become_image_tokens_with_grid_and_types(loaded):
    model = loaded("repo")
    prompts = Encoder(model).prompts(request(state="Compare img-1 with img-2.", assets={
        "img-1": {"data_base64": png("red", (64, 64))}, "img-2": {"data_base64": png("blue", (128, 64), "JPEG")}}))
    [prompt] = prompts
    image_id = model.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    grid = prompt.image_grid_thw
    assert grid.tolist() == [[1, 4, 4], [1, 4, 8]]  # 16-pixel patches
    tokens = (prompt.input_ids == image_id)
    assert int(tokens.sum()) == int(grid.prod(-1).sum()) // 4  # merge 2x2
    assert torch.equal(prompt.mm_token_type_ids.bool(), tokens)
    assert prompt.pixel_values.shape[0] == int(grid.prod(-1).sum())


def test_image_errors(loaded):
    encoder = Encoder(loaded("repo"), max_image_pixels=100 * 100)
    cases = [
        ({"data_base64": "not base64!"}, "not valid base64"),
        ({"data_base64": "aGVsbG8="}, "cannot decode image .not an image of a format read here: png, jpeg"),
        ({"data_base64": png("red", (64, 64))[:80]}, "cannot decode image"),
        ({"data_base64": png("red", (64, 64), "TIFF")}, "unsupported image format TIFF"),
        ({"data_base64": png("red", (200, 200))}, "over the limit"),
    ]
    for asset, message in cases:
        with pytest.raises(RequestError, match=message) as error:
            encoder.prompts(request(state="see img-1", assets={"img-1": asset}))
        assert error.value.code == ErrorCode.INVALID_IMAGE
        assert " at 0x" not in str(error.value) and "BytesIO" not in str(error.value)  # a plain message, no repr
    with pytest.raises(RequestError, match="text only"):
        Encoder(loaded("repo-text")).prompts(request(state="see img-1", assets={"img-1": {"data_base64": png()}}))


def test_the_pixel_limit_is_for_all_of_a_requests_images(loaded, monkeypatch):
    """Many images, each under the limit, over it together: refused from their headers, none decoded."""
    encoder = Encoder(loaded("repo"), max_image_pixels=100 * 100)
    assets = {f"img-{i}": {"data_base64": png("black", (60, 60))} for i in range(3)}  # 3600 pixels each
    loads = []
    monkeypatch.setattr(Image.Image, "load", lambda image: loads.append(image))
    with pytest.raises(RequestError, match=r"assets.img-2: with 60x60, 10800 pixels is over the limit of 10000"):
        encoder.prompts(request(state="see img-0 img-1 img-2", assets=assets))
    assert loads == []
    monkeypatch.undo()
    prompts = encoder.prompts(request(state="see img-0 img-1", assets=dict(list(assets.items())[:2])))
    assert prompts[0].image_grid_thw.shape[0] == 2


def test_a_state_over_the_character_bound_is_refused_before_rendering(loaded, monkeypatch):
    """A state that needs more tokens than the model reads by its characters as printed (CHARS_PER_TOKEN each, the
    runs of one character at the vocabulary's longest entry) is refused without being rendered or tokenized (which
    took seconds for megabytes); one character less, and it is rendered, and counted exactly."""
    encoder = Encoder(loaded("repo"))
    rendered = []
    monkeypatch.setattr(encoder, "_render", lambda body: rendered.append(body) or [])
    rate = min(CHARS_PER_TOKEN, encoder.max_token_chars)
    over = (encoder.max_length + 1) * rate  # characters: the fewest tokens is one over the model's maximum
    text = ("abcd efgh " * over)[:over]  # no run of one character
    with pytest.raises(RequestError, match=f"the state has {over} characters as printed, at least "
                                           f"{encoder.max_length + 1} tokens") as error:
        encoder.prompts(request(state=text))
    assert error.value.code == ErrorCode.STATE_TOO_LONG and rendered == []
    encoder.prompts(request(state=text[:-1]))
    assert len(rendered) == 1
    # Not only the strings of a state are printed: its keys and numbers too (a 2 MB array of numbers, or a state of
    # many keys, once took 25 s to be refused after rendering).
    numbers = list(range(over // 5))
    assert len(printed(numbers)) > over
    with pytest.raises(RequestError, match="characters as printed"):
        encoder.prompts(request(state=numbers))
    with pytest.raises(RequestError, match="characters as printed"):
        encoder.prompts(request(state={f"key {i}": None for i in range(over // 10)}))
    assert len(rendered) == 1


def test_runs_of_one_character_count_at_the_longest_token():
    """Padding and rules (runs of one character) may be one token as long as the vocabulary's longest entry (128
    spaces in Qwen3.5's): counted so, a state padded that way that fits is not refused."""
    assert fewest_tokens("word" + " " * 1000 + "x" * 20 + "y" * 12, 128) == (4 + 12) // 16 + 1020 // 128
    assert fewest_tokens("ab" * 100, 128) == 200 // CHARS_PER_TOKEN
    assert fewest_tokens("ab" * 100, 4) == 200 // 4  # never more characters a token than the longest entry
    assert printed("a string as it is") == "a string as it is" and printed({"k": [1, True, None]}) == \
        '{"k": [1, true, null]}'


def test_a_long_state_that_fits_is_not_refused_by_the_character_bound(loaded):
    """A state near the token limit (ordinary words, numbers, a padded table) is rendered and answered whole."""
    model = loaded("repo", max_prompt_tokens=1024)
    encoder = Encoder(model)
    one = {"q": {"type": "noul", "instructions": "Urgent?"}}
    frame = encoder.prompts(request(state="", questions=one))[0].length
    row = "Order 1234 was paid twice on the card.\n"
    per_row = (encoder.prompts(request(state=row * 8, questions=one))[0].length - frame) / 8
    state = row * int((encoder.max_length - frame) / per_row * 0.95)
    [prompt] = encoder.prompts(request(state=state, questions=one))
    assert encoder.max_length * 0.9 < prompt.length <= encoder.max_length


def test_model_specific_limits_are_invalid_requests(loaded):
    options = {f"o{i}": None for i in range(20)}  # the judge head reads 16 choice options
    with pytest.raises(RequestError, match="at most 16 options") as error:
        Encoder(loaded("judge")).prompts(request(questions={"c": {"type": "choice", "criteria": options}}))
    assert error.value.code == ErrorCode.INVALID_REQUEST
    # The repo head has 24 rows and choice options start at row 8: 16 options at most, though 26 labels exist.
    with pytest.raises(RequestError, match="scores at most 16 options") as error:
        Encoder(loaded("repo")).prompts(request(questions={"c": {"type": "choice", "criteria": options}}))
    assert error.value.code == ErrorCode.INVALID_REQUEST


def test_over_length_requests_split_by_question(loaded):
    model = loaded("repo", max_prompt_tokens=160)
    questions = {f"q{i}": {"type": "choice", "instructions": f"Question number {i}?",
                           "criteria": {"yes": "it is so", "no": "it is not"}} for i in range(12)}
    prompts = Encoder(model).prompts(request(state="A short state.", questions=questions))
    assert len(prompts) > 1
    assert all(c.length <= 160 for c in prompts)
    assert [q.name for c in prompts for q in c.questions] == list(questions)  # each once, in order
    # The same questions asked of a model that reads them at once give one prompt.
    assert len(Encoder(loaded("repo")).prompts(request(state="A short state.", questions=questions))) == 1


def test_only_some_questions(loaded):
    prompts = Encoder(loaded("repo")).prompts(request(), names=["urgency", "spam"])
    assert [q.name for q in prompts[0].questions] == ["urgency", "spam"]
    with pytest.raises(RequestError, match="no question named 'nope'"):
        Encoder(loaded("repo")).prompts(request(), names=["nope"])


def test_state_too_long_states_the_counts(loaded):
    model = loaded("repo", max_prompt_tokens=160)
    with pytest.raises(RequestError) as error:
        Encoder(model).prompts(request(state="word " * 400))
    assert error.value.code == ErrorCode.STATE_TOO_LONG
    assert "at most 160" in error.value.message and "tokens" in error.value.message
    with pytest.raises(RequestError, match="at most 160") as error:
        Encoder(loaded("readout", max_prompt_tokens=160)).prompts(request(state="word " * 400))
    assert error.value.code == ErrorCode.STATE_TOO_LONG


@pytest.mark.parametrize("name", ["repo", "repo-text", "judge"])
def test_the_vocabulary_is_read_once_and_the_prompts_are_transformers_own(loaded, name):
    """prepare_inputs asks for the whole vocabulary on every request (a fresh dict each time: about 0.1 s at
    Qwen3.5's 248k tokens); the encoder's own tokenizer answers with one copy, and renders exactly as before."""
    model = loaded(name)
    encoder = Encoder(model)
    tokenizer = getattr(encoder.processor, "tokenizer", encoder.processor)
    assert tokenizer.get_vocab() is tokenizer.get_vocab() and "<|mark|>" in tokenizer.get_vocab()
    fresh = copy.deepcopy(model.processor)  # marks added by prepare_inputs itself, on first use
    for state in ["hello", "I was charged twice. " * 40, 'a <|mark|> and a <|split|> in {"json": [1, 2]}', ""]:
        mine = encoder.prompts(request(state=state))
        theirs = prepare_inputs(model.decision_config, request(state=state).template_input(), fresh)
        assert [p.input_ids.tolist() for p in mine] == [inputs["input_ids"][0].tolist() for inputs, _ in theirs]
        assert [(p.rows + 1).tolist() for p in mine] == [inputs["marks"].tolist() for inputs, _ in theirs]
