"""Request -> prompts, with transformers.decision's own rendering (``prepare_inputs``).

A prompt is one prompt: the unit the engines pack. A template that reads ``questions`` renders one prompt for
all questions; a request whose prompt is longer than the model reads (its context, or ``--max-prompt-tokens``
where the operator set one) is split into prompts of its questions, each of which fits, and only then:
anything that fits runs whole (answers move when a prompt is split). Split prompts say so (``Prompt.split``),
and so do the prompts of a part that holds some of its request's questions. Nothing is ever truncated: a state
too long even for one question is refused with the token counts. Images arrive inline (base64) only and are
decoded here under a pixel limit; the worker never opens a path or URL.
"""

from __future__ import annotations

import base64
import binascii
import copy
import dataclasses
import io
import json
import re
import warnings
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

from PIL import Image
from jinja2 import TemplateError
from transformers.decision import DECISION_PROMPT, Question, prepare_inputs
from transformers.decision.template_utils import MARK, SPLIT
from transformers.tokenization_utils_base import AddedToken
from transformers.utils.chat_template_utils import _get_template_variables

from producer.wire.schema import ErrorCode, Request, RequestError

from .checkpoint import DecisionModel, RenderSpec
from .engine import Prompt

_PIL_FORMATS = {"PNG", "JPEG", "WEBP", "GIF", "BMP"}
_REPR = re.compile(r"<[^<>]* at 0x[0-9a-fA-F]+>")  # an object's repr, its address in it


def open_image(name: str, data_base64: str) -> Image.Image:
    """An inline image opened from its header only (nothing decoded yet): refuses unknown formats."""
    try:
        raw = base64.b64decode(data_base64, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(ErrorCode.INVALID_IMAGE,
                           f"assets.{name}: data_base64 is not valid base64") from None
    try:
        image = Image.open(io.BytesIO(raw))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombWarning,
            Image.DecompressionBombError) as error:
        raise RequestError(ErrorCode.INVALID_IMAGE, f"assets.{name}: cannot decode image ({_plain(error)})") from None
    if image.format not in _PIL_FORMATS:
        raise RequestError(ErrorCode.INVALID_IMAGE,
                           f"assets.{name}: unsupported image format {image.format} (png, jpeg, webp, gif, "
                           "bmp)")
    return image


def decode_images(assets: dict[str, str], max_pixels: int) -> dict[str, Image.Image]:
    """Decode a request's inline images (name -> base64), refusing unknown formats and more than
    ``max_pixels`` over all of them (decompression bombs, one large or many): every header is read before any
    pixel is decoded."""
    opened = {name: open_image(name, data) for name, data in assets.items()}
    total = 0
    for name, image in opened.items():
        width, height = image.size
        total += width * height
        if total > max_pixels:
            whose = f"{width}x{height}" if total == width * height else f"with {width}x{height}, {total} pixels"
            raise RequestError(ErrorCode.INVALID_IMAGE, f"assets.{name}: {whose} is over the limit of "
                                                        f"{max_pixels} pixels for all of a request's images")
    decoded = {}
    for name, image in opened.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image.load()
            decoded[name] = image.convert("RGB")
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombWarning,
                Image.DecompressionBombError) as error:
            raise RequestError(ErrorCode.INVALID_IMAGE, f"assets.{name}: cannot decode image ({_plain(error)})") from None
    return decoded


def _plain(error: BaseException) -> str:
    """What a decoder's error says, for a caller: Pillow names the file it read, here an object's repr with
    its address (``cannot identify image file <_io.BytesIO object at 0x7f...>``)."""
    if isinstance(error, Image.UnidentifiedImageError):
        return "not an image of a format read here: png, jpeg, webp, gif, bmp"
    return _REPR.sub("the data", str(error))[:200]


# The bound on a state checked before it is rendered and tokenized (seconds for megabytes: a 4.7 MB
# state took 26 s of a worker's CPU, its other callers waiting). Text takes far fewer characters a token
# than CHARS_PER_TOKEN (with Qwen3.5's vocabulary, measured: English docs 3.4, Python 4.0, JSON 1.7,
# numbers 1.0 as it splits them into digits, Chinese 2.2, a table padded with spaces 6.9), except in runs
# of one character (padding, a rule of '='), which a vocabulary may hold as one token as long as its
# longest entry (128 spaces in Qwen3.5's): runs are counted at that rate. A state that needs more tokens
# than the model reads by this count is refused (state_too_long); what passes is rendered, and counted
# exactly.
CHARS_PER_TOKEN = 16
RUN = re.compile(r"(.)\1{15,}", re.DOTALL)  # one character 16 times or more


def printed(state: Any) -> str:
    """The state as templates print it, give or take punctuation: a string as it is, anything else as
    its JSON (keys, numbers, true and false are printed too)."""
    return state if isinstance(state, str) else json.dumps(state, ensure_ascii=False)


def fewest_tokens(text: str, longest_token: int) -> int:
    """The fewest tokens ``text`` may take (CHARS_PER_TOKEN); ``longest_token``: the vocabulary's longest
    entry."""
    in_runs = sum(match.end() - match.start() for match in RUN.finditer(text))
    return (len(text) - in_runs) // min(CHARS_PER_TOKEN, longest_token) + in_runs // longest_token


class Encoder:
    """Renders and tokenizes requests for one model. Not thread-safe: give each planner thread its own."""

    def __init__(self, model: DecisionModel | RenderSpec, max_image_pixels: int = 4096 * 4096) -> None:
        self.config = model.decision_config
        # Fast tokenizers raise "Already borrowed" when used from two threads: each encoder owns a copy.
        self.processor = copy.deepcopy(model.processor)
        self.multimodal = model.multimodal
        self.max_length = model.max_length
        self.max_image_pixels = max_image_pixels
        self.max_options = {kind: model.max_options(kind) for kind in Question.questions_types}
        template = self.config.chat_template or DECISION_PROMPT
        self.one_prompt_for_all = "questions" in _get_template_variables(template)
        tokenizer = getattr(self.processor, "tokenizer", self.processor)
        _freeze_vocabulary(tokenizer)
        self.control_tokens = sorted({*tokenizer.added_tokens_encoder, "<|mark|>", "<|split|>"}, key=len, reverse=True)
        # A state far too long is refused before it is rendered and tokenized (CHARS_PER_TOKEN).
        self.renders_state = "state" in _get_template_variables(template)
        self.max_token_chars = max(len(token) for token in tokenizer.get_vocab()) or 1

    def prompts(self, request: Request, names: Sequence[str] | None = None) -> list[Prompt]:
        """The prompts of ``request`` (or of its questions ``names``), each at most ``max_length`` tokens."""
        body = request.template_input()
        self._bound_state(body["state"])
        hostile = _control_token_in_keys(body, self.control_tokens)
        if hostile:
            raise RequestError(ErrorCode.INVALID_REQUEST, hostile)
        if names is not None:
            missing = [n for n in names if n not in body["questions"]]
            if missing:
                raise RequestError(ErrorCode.INVALID_REQUEST, f"no question named {missing[0]!r} in the request")
            subset = self.one_prompt_for_all and len(names) < len(body["questions"])
            body["questions"] = {n: body["questions"][n] for n in names}
        else:
            subset = False
        if request.assets:
            if not self.multimodal:
                raise RequestError(ErrorCode.INVALID_REQUEST, "assets: this model reads text only")
            body["assets"] = decode_images({n: a.data_base64 for n, a in request.assets.items()},
                                           self.max_image_pixels)
        prompts = self._render(body)
        if all(prompt.length <= self.max_length for prompt in prompts):
            return [dataclasses.replace(prompt, split=True) for prompt in prompts] if subset else prompts
        if not self.one_prompt_for_all or len(body["questions"]) == 1:
            longest = max(prompts, key=lambda prompt: prompt.length)
            raise RequestError(ErrorCode.STATE_TOO_LONG, (
                f"the prompt of question {longest.questions[0].name!r} has {longest.length} tokens; this "
                f"model reads at most {self.max_length} per prompt"))
        return [dataclasses.replace(prompt, split=True) for prompt in self._split(body)]

    def _bound_state(self, state: Any) -> None:
        """Refuse a state that needs more tokens than the model reads by its characters (CHARS_PER_TOKEN),
        before anything else reads it (seconds for megabytes); runs are looked for only where they matter."""
        text = printed(state) if self.renders_state else ""
        if len(text) // min(CHARS_PER_TOKEN, self.max_token_chars) <= self.max_length:
            return
        if (fewest := fewest_tokens(text, self.max_token_chars)) > self.max_length:
            raise RequestError(ErrorCode.STATE_TOO_LONG, (
                f"the state has {len(text)} characters as printed, at least {fewest} tokens; this model "
                f"reads at most {self.max_length} per prompt"))

    def _render(self, body: dict[str, Any]) -> list[Prompt]:
        try:
            prompts = prepare_inputs(self.config, body, self.processor)
        except (ValueError, TemplateError, TypeError) as error:
            raise RequestError(ErrorCode.INVALID_REQUEST, str(error)) from None
        for inputs, questions in prompts:
            if len(inputs["marks"]) != len(questions):  # the head reads one row per question, never user text
                raise RequestError(ErrorCode.INVALID_REQUEST, (
                    f"the prompt has {len(inputs['marks'])} marks for {len(questions)} questions: control "
                    "tokens in user text?"))
            for question in questions:
                limit = self.max_options[question.type]
                if len(question.options) > limit:
                    raise RequestError(ErrorCode.INVALID_REQUEST, (
                        f"Question {question.name!r}: this model's head scores at most {limit} options "
                        f"for a {question.type} question, got {len(question.options)}"))
        return [_prompt(inputs, questions) for inputs, questions in prompts]

    def _length(self, body: dict[str, Any], names: Sequence[str]) -> int:
        return sum(c.length for c in self._render(_subset(body, names)))

    def _split(self, body: dict[str, Any]) -> list[Prompt]:
        """Greedy grouping of questions by their estimated token cost; each group is rendered and checked."""
        names = list(body["questions"])
        single: dict[str, int] = {}
        for name in names:  # the first too long alone ends it (each render of a long state costs)
            single[name] = self._length(body, [name])
            if single[name] > self.max_length:
                raise RequestError(ErrorCode.STATE_TOO_LONG, (
                    f"with question {name!r} alone the prompt has {single[name]} tokens; this model reads at "
                    f"most {self.max_length} per prompt: shorten the state"))
        # The state and the template's frame are in every prompt: estimate them from one pair.
        shared = max(0, single[names[0]] + single[names[1]] - self._length(body, names[:2]))
        groups: list[list[str]] = [[]]
        used = shared
        for name in names:
            cost = single[name] - shared
            if groups[-1] and used + cost > self.max_length:
                groups.append([])
                used = shared
            groups[-1].append(name)
            used += cost
        prompts: list[Prompt] = []
        for group in groups:
            prompts.extend(self._fit(body, group))
        return prompts

    def _fit(self, body: dict[str, Any], names: list[str]) -> list[Prompt]:
        rendered = self._render(_subset(body, names))
        if len(names) == 1 or all(c.length <= self.max_length for c in rendered):
            return rendered
        half = len(names) // 2  # the estimate was short: halve until each part fits
        return self._fit(body, names[:half]) + self._fit(body, names[half:])


def _control_token_in_keys(body: dict[str, Any], tokens: Sequence[str]) -> str | None:
    """transformers escapes control tokens in the strings of a request but not in the keys of its JSON
    objects, which templates print as they are: such a key could add a mark (moving where the head reads) or a
    chat token. The problem, or None. Iterative: the depth is bounded by the schema, the stack need not be."""
    stack: list[tuple[Any, str]] = [(body["state"], "state")]
    for name, question in body["questions"].items():
        stack.append((question.get("instructions"), f"questions.{name}.instructions"))
        criteria = question.get("criteria")
        if isinstance(criteria, dict):
            stack += [(value, f"questions.{name}.criteria.{option}") for option, value in criteria.items()]
        elif isinstance(criteria, list):
            stack += [(value, f"questions.{name}.criteria.{i}") for i, value in enumerate(criteria)]
    while stack:
        value, where = stack.pop()
        if isinstance(value, dict):
            for key, inner in value.items():
                token = next((t for t in tokens if t in key), None)
                if token:
                    return (f"{where}: the key {key[:80]!r} holds the control token {token!r}; keys are not "
                            "escaped, put such text in values")
                stack.append((inner, f"{where}.{key[:40]}"))
        elif isinstance(value, list):
            stack += [(inner, f"{where}.{i}") for i, inner in enumerate(value)]
    return None


def _freeze_vocabulary(tokenizer: Any) -> None:
    """``prepare_inputs`` asks for the tokenizer's whole vocabulary on every request, only to see whether its mark
    tokens are in it, and a fast tokenizer builds a fresh dict of every token each time: 0.07 ms at the tiny
    checkpoint's 512 tokens, about 0.1 s at Qwen3.5's 248,320 (ops/bench/planning.py). The marks are added here
    once, as ``prepare_inputs`` would add them, and this encoder's own copy of the tokenizer then answers with one
    read-only copy of its vocabulary: nothing adds tokens to it afterwards."""
    vocabulary = tokenizer.get_vocab()
    if MARK not in vocabulary:
        tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in (MARK, SPLIT)])
        vocabulary = tokenizer.get_vocab()
    frozen = MappingProxyType(vocabulary)
    tokenizer.get_vocab = lambda: frozen


def _subset(body: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    return {**body, "questions": {n: body["questions"][n] for n in names}}


def _prompt(inputs: dict[str, Any], questions: list[Question]) -> Prompt:
    mm = inputs.get("mm_token_type_ids")
    grid = inputs.get("image_grid_thw")
    return Prompt(
        input_ids=inputs["input_ids"][0].contiguous(),
        rows=(inputs["marks"] - 1).contiguous(),
        questions=tuple(questions),
        pixel_values=inputs.get("pixel_values") if grid is not None else None,
        image_grid_thw=grid,
        mm_token_type_ids=mm[0].contiguous() if mm is not None and grid is not None else None,
    )
