import json
import shutil
from pathlib import Path

import pytest
import torch

from worker.model import checkpoint, tiny
from worker.model.checkpoint import CheckpointError


@pytest.mark.parametrize("name, backbone, noncausal, softcap", [
    ("repo", "Qwen3_5Model", True, 30.0),
    ("repo-text", "Qwen3_5TextModel", True, 30.0),
    ("readout", "Qwen3_5Model", True, None),
    ("readout-text", "Qwen3_5TextModel", True, None),
    ("judge", "Qwen3_5TextModel", False, 30.0),
])
def test_every_format_loads(loaded, name, backbone, noncausal, softcap):
    model = loaded(name)
    assert type(model.backbone).__name__ == backbone
    assert model.noncausal is noncausal
    assert model.softcap == softcap
    assert model.multimodal is (backbone == "Qwen3_5Model")
    assert model.dtype == torch.float32 and model.device.type == "cpu"


def test_formats_carry_their_decision_configs(loaded):
    readout, judge, repo = loaded("readout"), loaded("judge"), loaded("repo-text")
    assert readout.decision_config.labels["choice"][:3] == ["A", "B", "C"]  # vLLM codes for every type
    assert readout.offsets == {"noul": 0, "choice": 0, "score": 0}
    assert judge.decision_config.temperature == {"noul": 1.0, "choice": 0.9, "score": 1.1}  # calibration.json
    assert judge.offsets == {"noul": 0, "score": 2, "choice": 8}  # judge_config slot ranges
    assert repo.decision_config.temperature["score"] == 1.25
    # Same seed and backbone, same weights, whatever the format.
    assert torch.equal(repo.model.proj.weight, judge.model.proj.weight)


def test_tiny_checkpoint_is_deterministic(tmp_path):
    a = checkpoint.load(tiny.write(tmp_path / "a", seed=3, multimodal=False))
    b = checkpoint.load(tiny.write(tmp_path / "b", seed=3, multimodal=False))
    c = checkpoint.load(tiny.write(tmp_path / "c", seed=4, multimodal=False))
    for (name, x), (_, y), (_, z) in zip(a.model.state_dict().items(), b.model.state_dict().items(),
                                         c.model.state_dict().items()):
        assert torch.equal(x, y), name
    assert not torch.equal(a.model.proj.weight, c.model.proj.weight)
    assert a.tokenizer.get_vocab() == b.tokenizer.get_vocab()


def test_transformers_loads_the_tiny_checkpoint_offline(tiny_dir):
    from transformers import AutoModelForDecision, pipeline

    model = AutoModelForDecision.from_pretrained(str(tiny_dir), local_files_only=True)
    assert type(model).__name__ == "JevForDecision"
    decide = pipeline("decision", model=str(tiny_dir))
    out = decide({"state": "WIN a FREE phone", "questions": {"spam": {"type": "noul", "instructions": "Spam?"}}})
    assert out["spam"]["type"] == "noul" and 0.0 <= out["spam"]["noul"] <= 1.0


def test_not_a_decision_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="is not a directory"):
        checkpoint.load(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    with pytest.raises(CheckpointError, match="not a decision checkpoint"):
        checkpoint.load(tmp_path)


def test_unsupported_backbone(tmp_path, checkpoints):
    path = shutil.copytree(checkpoints["readout-text"], tmp_path / "ck")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    with pytest.raises(CheckpointError, match="backbone 'qwen2' is not served"):
        checkpoint.load(path)


def test_missing_tokenizer_and_image_processor(tmp_path, checkpoints):
    path = shutil.copytree(checkpoints["repo"], tmp_path / "ck")
    (path / "preprocessor_config.json").unlink()
    with pytest.raises(CheckpointError, match="image processor"):
        checkpoint.load(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).unlink()
    with pytest.raises(CheckpointError, match="no tokenizer"):
        checkpoint.load(path)


def test_image_processor_is_qwen3_5s(loaded):
    processor = loaded("repo").processor.image_processor
    assert (processor.patch_size, processor.merge_size) == (16, 2)
    assert list(processor.image_mean) == [0.5, 0.5, 0.5] and list(processor.image_std) == [0.5, 0.5, 0.5]


def test_device_and_dtype_options(checkpoints):
    with pytest.raises(CheckpointError, match="dtype"):
        checkpoint.load(checkpoints["repo-text"], dtype="int8")
    model = checkpoint.load(checkpoints["repo-text"], device="cpu", dtype="bfloat16", max_prompt_tokens=100)
    assert model.dtype == torch.bfloat16 and model.max_length == 100
    if not torch.cuda.is_available():
        with pytest.raises(CheckpointError, match="CUDA"):
            checkpoint.load(checkpoints["repo-text"], device="cuda")


def test_tiny_checkpoints_are_readable_by_every_user(checkpoints):
    """The image's unprivileged user reads a checkpoint another user wrote (the weights were once 0600)."""
    for directory in checkpoints.values():
        for file in Path(directory).iterdir():
            assert file.stat().st_mode & 0o444 == 0o444, file
