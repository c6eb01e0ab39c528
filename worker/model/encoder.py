"""Request -> prompts -> chunks, with transformers.decision's own rendering (``prepare_inputs``).

A chunk is one prompt: the unit the engines pack. A template that reads ``questions`` renders one prompt for all
questions; a request whose prompt is longer than the model reads is split into chunks of its questions, each of
which fits. Nothing is ever truncated: a state too long even for one question is refused with the token counts.
Images arrive inline (base64) only and are decoded here under a pixel limit; the worker never opens a path or URL.
"""

from __future__ import annotations

import base64
import binascii
import copy
import io
import warnings
from collections.abc import Sequence
from typing import Any

from jinja2 import TemplateError
from PIL import Image
from transformers.decision import DECISION_PROMPT, Question, prepare_inputs
from transformers.utils.chat_template_utils import _get_template_variables

from producer.schema import ErrorCode, Request, RequestError

from .checkpoint import DecisionModel, RenderSpec
from .engine import Chunk

_PIL_FORMATS = {"PNG", "JPEG", "WEBP", "GIF", "BMP"}


def decode_image(name: str, data_base64: str, max_pixels: int) -> Image.Image:
    """Decode an inline image, refusing unknown formats and oversized (decompression bomb) images."""
    try:
        raw = base64.b64decode(data_base64, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(ErrorCode.INVALID_IMAGE, f"assets.{name}: data_base64 is not valid base64") from None
    try:
        image = Image.open(io.BytesIO(raw))
        if image.format not in _PIL_FORMATS:
            raise RequestError(ErrorCode.INVALID_IMAGE,
                               f"assets.{name}: unsupported image format {image.format} (png, jpeg, webp, gif, bmp)")
        width, height = image.size
        if width * height > max_pixels:  # checked from the header, before any pixel is decoded
            raise RequestError(ErrorCode.INVALID_IMAGE,
                               f"assets.{name}: {width}x{height} is over the limit of {max_pixels} pixels")
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()
        return image.convert("RGB")
    except RequestError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombWarning, Image.DecompressionBombError) as error:
        raise RequestError(ErrorCode.INVALID_IMAGE, f"assets.{name}: cannot decode image ({error})") from None


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
        self.control_tokens = sorted({*tokenizer.added_tokens_encoder, "<|mark|>", "<|split|>"}, key=len, reverse=True)

    def plan(self, request: Request, names: Sequence[str] | None = None) -> list[Chunk]:
        """The chunks of ``request`` (or of its questions ``names``), each at most ``max_length`` tokens."""
        body = request.template_input()
        hostile = _control_token_in_keys(body, self.control_tokens)
        if hostile:
            raise RequestError(ErrorCode.INVALID_REQUEST, hostile)
        if names is not None:
            missing = [n for n in names if n not in body["questions"]]
            if missing:
                raise RequestError(ErrorCode.INVALID_REQUEST, f"no question named {missing[0]!r} in the request")
            body["questions"] = {n: body["questions"][n] for n in names}
        if request.assets:
            if not self.multimodal:
                raise RequestError(ErrorCode.INVALID_REQUEST, "assets: this model reads text only")
            body["assets"] = {n: decode_image(n, a.data_base64, self.max_image_pixels)
                              for n, a in request.assets.items()}
        chunks = self._render(body)
        if all(chunk.length <= self.max_length for chunk in chunks):
            return chunks
        if not self.one_prompt_for_all or len(body["questions"]) == 1:
            longest = max(chunks, key=lambda chunk: chunk.length)
            raise RequestError(ErrorCode.STATE_TOO_LONG, (
                f"the prompt of question {longest.questions[0].name!r} has {longest.length} tokens; this model "
                f"reads at most {self.max_length} per prompt"))
        return self._split(body)

    def _render(self, body: dict[str, Any]) -> list[Chunk]:
        try:
            prompts = prepare_inputs(self.config, body, self.processor)
        except (ValueError, TemplateError, TypeError) as error:
            raise RequestError(ErrorCode.INVALID_REQUEST, str(error)) from None
        for inputs, questions in prompts:
            if len(inputs["marks"]) != len(questions):  # the head reads one row per question, never user text
                raise RequestError(ErrorCode.INVALID_REQUEST, (
                    f"the prompt has {len(inputs['marks'])} marks for {len(questions)} questions: control tokens in "
                    "user text?"))
            for question in questions:
                limit = self.max_options[question.type]
                if len(question.options) > limit:
                    raise RequestError(ErrorCode.INVALID_REQUEST, (
                        f"Question {question.name!r}: this model's head scores at most {limit} options "
                        f"for a {question.type} question, got {len(question.options)}"))
        return [_chunk(inputs, questions) for inputs, questions in prompts]

    def _length(self, body: dict[str, Any], names: Sequence[str]) -> int:
        return sum(c.length for c in self._render(_subset(body, names)))

    def _split(self, body: dict[str, Any]) -> list[Chunk]:
        """Greedy grouping of questions by their estimated token cost; each group is rendered and checked."""
        names = list(body["questions"])
        single = {n: self._length(body, [n]) for n in names}
        too_long = [n for n in names if single[n] > self.max_length]
        if too_long:
            raise RequestError(ErrorCode.STATE_TOO_LONG, (
                f"with question {too_long[0]!r} alone the prompt has {single[too_long[0]]} tokens; this model "
                f"reads at most {self.max_length} per prompt: shorten the state"))
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
        chunks: list[Chunk] = []
        for group in groups:
            chunks.extend(self._fit(body, group))
        return chunks

    def _fit(self, body: dict[str, Any], names: list[str]) -> list[Chunk]:
        rendered = self._render(_subset(body, names))
        if len(names) == 1 or all(c.length <= self.max_length for c in rendered):
            return rendered
        half = len(names) // 2  # the estimate was short: halve until each part fits
        return self._fit(body, names[:half]) + self._fit(body, names[half:])


def _control_token_in_keys(body: dict[str, Any], tokens: Sequence[str]) -> str | None:
    """transformers escapes control tokens in the strings of a request but not in the keys of its JSON objects,
    which templates print as they are: such a key could add a mark (moving where the head reads) or a chat token.
    The problem, or None. Iterative: the depth is bounded by the schema, the stack need not be."""
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
                    return (f"{where}: the key {key[:80]!r} holds the control token {token!r}; keys are not escaped, "
                            "put such text in values")
                stack.append((inner, f"{where}.{key[:40]}"))
        elif isinstance(value, list):
            stack += [(inner, f"{where}.{i}") for i, inner in enumerate(value)]
    return None


def _subset(body: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    return {**body, "questions": {n: body["questions"][n] for n in names}}


def _chunk(inputs: dict[str, Any], questions: list[Question]) -> Chunk:
    mm = inputs.get("mm_token_type_ids")
    grid = inputs.get("image_grid_thw")
    return Chunk(
        input_ids=inputs["input_ids"][0].contiguous(),
        rows=(inputs["marks"] - 1).contiguous(),
        questions=tuple(questions),
        pixel_values=inputs.get("pixel_values") if grid is not None else None,
        image_grid_thw=grid,
        mm_token_type_ids=mm[0].contiguous() if mm is not None and grid is not None else None,
    )
