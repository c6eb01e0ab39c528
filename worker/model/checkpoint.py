"""Load a decision checkpoint with transformers' own machinery, offline, into one ``DecisionModel``.

Formats (all read by ``AutoModelForDecision``): a repo written by ``save_pretrained`` (``config.json`` of type
``jev`` + ``decision.json``), a backbone with ``decision_config.json`` + ``readout.safetensors`` (vLLM
decision models), and a backbone with ``judge_config.json`` + ``head.safetensors`` + ``calibration.json``
(JEV).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForDecision, AutoTokenizer
from transformers.decision import DecisionConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin

SERVED_BACKBONES = ("qwen3_5", "qwen3_5_text")
# The Qwen3.5 image processor: Qwen2VLImageProcessor's defaults are Qwen2-VL's (patch 14, CLIP mean/std), not
# these.
QWEN3_5_IMAGE_DEFAULTS: dict[str, Any] = {
    "patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}
_IMAGE_KEYS = ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std", "size",
               "min_pixels", "max_pixels", "do_resize", "do_rescale", "rescale_factor", "do_normalize",
               "do_convert_rgb", "resample")


class CheckpointError(ValueError):
    """The directory cannot be served: the message says what is missing or unsupported."""


class DecisionProcessor(Qwen3VLProcessor):
    """Qwen3-VL's processor for text and images only. Its video processor needs torchvision, which the worker
    does not depend on; everything else (image token expansion, ``mm_token_type_ids``) is
    Qwen3VLProcessor's."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                 **kwargs: Any) -> None:
        ids = tokenizer.convert_tokens_to_ids
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
        self.image_token_id, self.video_token_id = ids(self.image_token), ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
        self.vision_start_token_id, self.vision_end_token_id = ids(self.vision_start_token), ids(self.vision_end_token)


@dataclass(frozen=True)
class RenderSpec:
    """What rendering and tokenizing need of a checkpoint, without the weights: picklable, so planner
    processes can build their own encoders."""

    decision_config: DecisionConfig
    processor: Any
    multimodal: bool
    max_length: int
    options: dict[str, int]  # options the head scores per question type

    def max_options(self, kind: str) -> int:
        return self.options[kind]


@dataclass
class DecisionModel:
    """A loaded checkpoint: the model, how to render requests for it, and the facts the engines need."""

    model: torch.nn.Module  # JevForDecision: ``model`` (backbone) + ``proj`` (head)
    decision_config: DecisionConfig
    processor: Any  # DecisionProcessor for multimodal backbones, else the tokenizer
    name: str
    multimodal: bool
    max_length: int

    @property
    def backbone(self) -> torch.nn.Module:
        return self.model.model

    @property
    def language_model(self) -> torch.nn.Module:
        return getattr(self.backbone, "language_model", self.backbone)

    @property
    def text_config(self) -> Any:
        config = self.model.config.text_config
        return getattr(config, "text_config", config)

    @property
    def device(self) -> torch.device:
        return self.model.proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.proj.weight.dtype

    @property
    def noncausal(self) -> bool:
        return not getattr(self.text_config, "is_causal", True)

    @property
    def offsets(self) -> dict[str, int]:
        return dict(self.model.config.offsets)

    def max_options(self, kind: str) -> int:
        """Options the head can score for a question type: its rows from the type's offset on."""
        return self.model.config.num_verbalizers - self.offsets[kind]

    def render_spec(self) -> RenderSpec:
        return RenderSpec(self.decision_config, self.processor, self.multimodal, self.max_length,
                          {kind: self.max_options(kind) for kind in self.offsets})

    @property
    def softcap(self) -> float | None:
        return self.model.config.softcap

    @property
    def tokenizer(self) -> Any:
        return getattr(self.processor, "tokenizer", self.processor)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return 0 if pad is None else int(pad)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: cannot read JSON ({error})") from None


# A Hugging Face cache holds a checkpoint at models--ORG--NAME/snapshots/REVISION: its folder's name is a
# commit hash.
HUB_CACHE = re.compile(r"models--(?:(?P<org>[^/]+?)--)?(?P<name>[^/]+)/snapshots/[^/]+$")
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def own_name(path: Path) -> str:
    """The name a checkpoint gives itself, which a worker serves it under unless told otherwise: the hub id
    its ``config.json`` records (``_name_or_path``, written by transformers before v5, when it is an id and
    not a path), else the hub id of a Hugging Face cache snapshot it sits in, else its folder's name."""
    config = path / "config.json"
    recorded = _read_json(config).get("_name_or_path") if config.exists() else None
    if isinstance(recorded, str) and HUB_ID.fullmatch(recorded):
        return recorded
    resolved = path.resolve()
    cached = HUB_CACHE.search(resolved.as_posix())
    if cached:
        return f"{cached['org']}/{cached['name']}" if cached["org"] else cached["name"]
    return resolved.name


def detect_format(path: Path) -> str:
    """``judge``, ``readout`` or ``repo``; raises CheckpointError for a directory that is not a decision
    checkpoint."""
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    if (path / "judge_config.json").exists():
        return "judge"
    if (path / "decision_config.json").exists():
        return "readout"
    config = path / "config.json"
    if config.exists() and _read_json(config).get("model_type") == "jev":
        return "repo"
    raise CheckpointError(
        f"{path} is not a decision checkpoint: expected judge_config.json (+ head.safetensors), "
        "decision_config.json (+ readout.safetensors), or a config.json of model_type 'jev' "
        "(save_pretrained)")


def backbone_type(path: Path, fmt: str) -> str:
    config = _read_json(path / "config.json") if (path / "config.json").exists() else None
    if config is None:
        raise CheckpointError(f"{path} has no config.json for its backbone")
    if fmt == "repo":
        config = config.get("text_config") or {}
    return str(config.get("model_type"))


def image_processor_from(path: Path) -> Qwen2VLImageProcessorPil:
    """The Qwen3.5 image processor, with the checkpoint's own settings over the Qwen3.5 defaults."""
    settings: dict[str, Any] = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        if (path / name).exists():
            data = _read_json(path / name)
            settings = data.get("image_processor", data)
            break
    else:
        raise CheckpointError(f"{path}: a multimodal backbone needs its image processor settings "
                              "(preprocessor_config.json or processor_config.json)")
    values = dict(QWEN3_5_IMAGE_DEFAULTS)
    values.update({k: v for k, v in settings.items() if k in _IMAGE_KEYS})
    return Qwen2VLImageProcessorPil(**values)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(f"device {device!r} asked for, but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    except KeyError:
        raise CheckpointError(f"dtype must be auto, bfloat16, float16 or float32, got {dtype!r}") from None


def _merge_adapter(model: torch.nn.Module, path: Path, subfolder: str) -> torch.nn.Module:
    """JEV checkpoints may ship their LoRA unmerged: merge it so that every engine sees plain weights."""
    try:
        from peft import PeftModel
    except ImportError:
        raise CheckpointError(f"{path / subfolder} holds a LoRA adapter: install peft to merge it at load, "
                              "or merge it into the weights once (PeftModel.merge_and_unload) and remove the "
                              "folder"
                              ) from None
    model.model = PeftModel.from_pretrained(model.model, str(path / subfolder)).merge_and_unload()
    return model


def load(path: str | Path, device: str = "auto", dtype: str = "auto", max_prompt_tokens: int | None = None
         ) -> DecisionModel:
    """Load ``path`` offline; errors name what is wrong with the directory."""
    path = Path(path)
    fmt = detect_format(path)
    kind = backbone_type(path, fmt)
    if kind not in SERVED_BACKBONES:
        raise CheckpointError(f"{path}: backbone {kind!r} is not served here (served: "
                              f"{', '.join(SERVED_BACKBONES)})")
    if not ((path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()):
        raise CheckpointError(f"{path} has no tokenizer (tokenizer.json / tokenizer_config.json)")
    multimodal = kind == "qwen3_5"
    image_processor = image_processor_from(path) if multimodal else None
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)

    model = AutoModelForDecision.from_pretrained(str(path), dtype=torch_dtype, local_files_only=True)
    adapter = model.decision_config.adapter
    if adapter and (path / adapter).is_dir():
        model = _merge_adapter(model, path, adapter)
    model = model.to(torch_device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    processor: Any = tokenizer
    if multimodal:
        processor = DecisionProcessor(image_processor, tokenizer, chat_template=tokenizer.chat_template or "")

    text_config = model.config.text_config
    text_config = getattr(text_config, "text_config", text_config)
    max_length = int(getattr(text_config, "max_position_embeddings", 0) or 1 << 20)
    if max_prompt_tokens:
        max_length = min(max_length, max_prompt_tokens)
    return DecisionModel(model=model, decision_config=model.decision_config, processor=processor,
                         name=own_name(path), multimodal=multimodal, max_length=max_length)
