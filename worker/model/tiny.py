"""A tiny random Qwen3.5 decision checkpoint, deterministic from a seed, for tests and the demo.

Everything a real checkpoint has, at toy sizes: linear- and full-attention layers ([L, L, L, F]), noncausal
full attention, a small vision tower, a byte-level BPE tokenizer with the special tokens the templates use, a
decision template with a ``<|mark|>`` per question, and the head. ``AutoModelForDecision.from_pretrained`` and
``pipeline("decision", ...)`` load it offline. ``fmt`` writes the same weights in any of the three formats.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>", "<|mark|>", "<|split|>", "<think>", "</think>"]

# One prompt for all questions; a mark after each. Image blocks print the Qwen vision tokens.
TINY_TEMPLATE = r"""
{%- macro render(x) -%}
{%- if x is none -%}
{%- elif x is string -%}{{ x }}
{%- elif x is mapping and x.get("type") == "image" -%}{{ "<|vision_start|><|image_pad|><|vision_end|>" }}
{%- elif x is mapping and x.get("type") == "text" -%}{{ x["text"] }}
{%- elif x is mapping -%}{{ "{" }}{%- for k, v in x.items() -%}{{ k|tojson ~ ": " }}{{ render(v) }}{{ ", " if not loop.last }}{%- endfor -%}{{ "}" }}
{%- elif x is sequence -%}{%- for p in x -%}{{ render(p) }}{{ " " if not loop.last }}{%- endfor -%}
{%- else -%}{{ x|tojson }}
{%- endif -%}
{%- endmacro -%}
{{- "<|im_start|>user\n[state] " }}{{ render(state) }}
{%- for q in questions -%}
{{ "\n[" ~ q.type ~ "] " }}{{ render(q.instructions) }}
{%- for o in q.options -%}
{{ "\n" ~ q.labels[loop.index0] ~ ") " ~ o }}{% if q.descriptions[loop.index0] is not none %}{{ ": " }}{{ render(q.descriptions[loop.index0]) }}{% endif %}
{%- endfor -%}
{{ "\n[answer]<|mark|>" }}
{%- endfor -%}
{{- "<|im_end|>" -}}
"""

CORPUS = [
    "The quick brown fox jumps over the lazy dog while the customer waits for a refund of the order.",
    "Is this message spam? What is the tone of the reply? How urgent is the request, from low to high?",
    "I was charged twice for my order and want a refund. The parcel arrived damaged, please help.",
    "WIN a FREE phone, click here now! Limited offer, reply STOP to unsubscribe from these messages.",
    "state question answer choice score noul true false calm angry polite pushy urgent today week month",
    "Look at the picture: a red square, a blue circle and a green triangle on a white background.",
    '{"message": "hello", "user": {"name": "Ada", "plan": "pro"}, "items": [1, 2, 3]}',
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}<>-_/\\|@#$%^&*+=~`",
]


def build_tokenizer(vocab_size: int = 512):
    """Byte-level BPE in the Qwen3.5 tokenizer class, trained on a fixed corpus (deterministic)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX, Qwen3_5Tokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS * 8, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Qwen3_5Tokenizer(vocab=model["vocab"], merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    return tokenizer


# "small": still quick, but with the head dimensions GPU kernels support (fla / FlashQLA want 128-wide linear
# heads; varlen FlashAttention 64-wide heads) and two [L, L, L, F] blocks; the GPU tests use it.
SIZES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, linear_key_head_dim=16, linear_value_head_dim=16,
                 linear_num_key_heads=2, linear_num_value_heads=4, mrope_section=[2, 1, 1]),
    "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_num_key_heads=2, linear_num_value_heads=4, mrope_section=[3, 3, 2]),
}


def backbone_config(tokenizer, multimodal: bool = True, noncausal: bool = True, max_positions: int = 4096,
                    size: str = "tiny"):
    from transformers import Qwen3_5Config, Qwen3_5TextConfig

    ids = tokenizer.convert_tokens_to_ids
    vocab = (len(tokenizer) + 63) // 64 * 64
    dims = dict(SIZES[size])
    mrope_section = dims.pop("mrope_section")
    text = dict(
        vocab_size=vocab, **dims, max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": mrope_section, "mrope_interleaved": True},
        is_causal=not noncausal, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=ids("<|im_end|>"))
    if not multimodal:
        return Qwen3_5TextConfig(**text)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=dims["hidden_size"], num_position_embeddings=64, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2)
    return Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=ids("<|image_pad|>"),
                         video_token_id=ids("<|video_pad|>"), vision_start_token_id=ids("<|vision_start|>"),
                         vision_end_token_id=ids("<|vision_end|>"), tie_word_embeddings=True)


def rendering(max_length: int = 8192, max_options: int = 8):
    """The tiny checkpoint's template and tokenizer (text only) as a RenderSpec, without its weights: requests
    rendered with it have the tiny checkpoint's token counts. The benchmarks size their requests with it and
    let their random models render with it."""
    from transformers.decision import DecisionConfig

    from .checkpoint import RenderSpec

    return RenderSpec(DecisionConfig(chat_template=TINY_TEMPLATE.strip()), build_tokenizer(),
                      False, max_length, dict.fromkeys(("noul", "choice", "score"), max_options))


def write(directory: str | Path, seed: int = 0, fmt: str = "repo", multimodal: bool = True,
          max_positions: int = 4096, size: str = "tiny") -> Path:
    """Write a tiny checkpoint to ``directory`` in format ``repo``, ``readout`` or ``judge``; ``size`` is a
    key of ``SIZES``."""
    from transformers import JevConfig, JevForDecision
    from transformers.decision import DecisionConfig

    from .checkpoint import QWEN3_5_IMAGE_DEFAULTS

    if fmt not in ("repo", "readout", "judge"):
        raise ValueError(f"format must be repo, readout or judge, got {fmt!r}")
    if fmt == "judge" and multimodal:
        raise ValueError("the JEV (judge) template is text only: use multimodal=False")
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    # JEV checkpoints are causal language models; the others read with noncausal full attention.
    backbone = backbone_config(tokenizer, multimodal, noncausal=fmt != "judge", max_positions=max_positions,
                               size=size)
    torch.manual_seed(seed)
    offsets = {"noul": 0, "score": 2, "choice": 8}
    config = JevConfig(text_config=backbone, hidden_size=SIZES[size]["hidden_size"], num_verbalizers=24,
                       offsets=dict.fromkeys(offsets, 0) if fmt == "readout" else offsets,
                       softcap=30.0 if fmt != "readout" else None)
    model = JevForDecision(config).eval()
    with torch.no_grad():  # a head with some spread, so that answers differ between inputs
        model.proj.weight.normal_(0.0, 0.5)
        model.proj.bias.normal_(0.0, 0.1) if fmt != "readout" else model.proj.bias.zero_()

    tokenizer.save_pretrained(path)
    if multimodal:
        (path / "preprocessor_config.json").write_text(json.dumps(
            {"image_processor_type": "Qwen2VLImageProcessor", **QWEN3_5_IMAGE_DEFAULTS,
             "size": {"shortest_edge": 32 * 32, "longest_edge": 448 * 448}}, indent=2) + "\n")
    if fmt == "repo":
        model.decision_config = DecisionConfig(chat_template=TINY_TEMPLATE.strip(),
                                               temperature={"noul": 1.0, "choice": 0.8, "score": 1.25})
        model.save_pretrained(path)
        return _readable(path)

    # Backbone-only checkpoints: the backbone's own weights and config, the head in a file of its own.
    backbone_state = {f"model.{k}": v.contiguous() for k, v in model.model.state_dict().items()}
    save_file(backbone_state, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.model.config.save_pretrained(path)
    labels = [chr(ord("A") + i) for i in range(config.num_verbalizers)]
    if fmt == "readout":
        save_file({"weight": model.proj.weight.contiguous()}, str(path / "readout.safetensors"))
        (path / "decision_config.json").write_text(json.dumps(
            {"codes": labels, "temperature": 1.0, "prompt": "d3",
             "attention_mode": "noncausal_full_attention"},
            indent=2) + "\n")
    else:
        save_file({"proj.weight": model.proj.weight.contiguous(), "proj.bias": model.proj.bias.contiguous()},
                  str(path / "head.safetensors"))
        ranges = {kind: [start, start + (2 if kind == "noul" else 6 if kind == "score" else 16)]
                  for kind, start in offsets.items()}
        (path / "judge_config.json").write_text(json.dumps(
            {"slots": {"num_slots": config.num_verbalizers, "verbalizers": labels, "ranges": ranges},
             "softcap": 30.0}, indent=2) + "\n")
        (path / "calibration.json").write_text(json.dumps(
            {"per_kind": {"noul": 1.0, "choice": 0.9, "score": 1.1}}, indent=2) + "\n")
    return _readable(path)


def _readable(path: Path) -> Path:
    """Every file readable by all: the weights are written 0600 (a temporary file renamed), which the image's
    unprivileged user could not read from a checkpoint written by another user (a mounted volume)."""
    for file in path.iterdir():
        if file.is_file():
            file.chmod(file.stat().st_mode | 0o444)
    return path
