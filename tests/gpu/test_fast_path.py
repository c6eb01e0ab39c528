"""The fast engine on a GPU equals the padded reference engine of the same checkpoint, for every option.

Checkpoint: ``tiny.write(size="small")`` (fla's and FlashQLA's kernels need 128-wide linear heads; the tiny one has
16), multimodal, noncausal, loaded in bf16 and in fp32. Requests: text of many lengths, images, requests split
over several prompts. Packs are formed greedily up to the engine's budget, as the daemon's packer does.

Tolerance (documented in docs/BENCHMARKS.md): bf16 is not exact, so the yardstick is the fp32 reference. The fast
path's error against it, as the largest probability difference over all options, must stay within twice the bf16
reference's own error plus 0.02, and its argmax flips within the bf16 reference's plus 5% of the questions.
FP8 (3 mantissa bits against bf16's 7) is held to its mean error instead: on this small random model rounding
details alone move single questions by 0.2-0.7 (eager FP8, which equals the dequantised matmul exactly, gives 0.68
on these prompts on the CPU), whereas a wiring fault moves every question. Its mean per-question difference must stay
within 0.1 and its flips within the bf16 reference's plus 15%; the largest difference is reported. Pack
composition: the same prompts in other packs, orders and buckets may move a probability by no more than the bf16
reference's error plus 0.02.

Set DQ_GPU_REPORT=path to append every measured figure as a JSON line.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("fla", reason="the fast engine needs flash-linear-attention")

from producer.wire.schema import Request  # noqa: E402
from support import png, report  # noqa: E402
from worker.config import Settings  # noqa: E402
from worker.fast import FastEngine  # noqa: E402
from worker.model import checkpoint, tiny  # noqa: E402
from worker.model.encoder import Encoder  # noqa: E402
from worker.model.readout import option_logits  # noqa: E402
from worker.model.reference import ReferenceEngine  # noqa: E402

MAX_PROMPT = 512
BUCKETS = "512,1024,2048"
QUESTIONS = {
    "spam": {"type": "noul", "instructions": "Is this spam?"},
    "tone": {"type": "choice", "criteria": {"calm": "polite", "angry": None, "pushy": "pressure", "sad": None}},
    "urgency": {"type": "score", "instructions": "How urgent?",
                "criteria": ["none", "low", "medium", "high", "now"]},
}
CONFIGS = {  # name -> Settings fields; together they cover every option and mode (most telling first)
    "eager": dict(compile="none", cuda_graphs=False, prune_last=False),
    "layer+graphs+prune": dict(compile="layer", cuda_graphs=True, prune_last=True),
    "graphs+prune": dict(compile="none", cuda_graphs=True, prune_last=True),
    "fp8+layer+graphs+prune": dict(compile="layer", cuda_graphs=True, prune_last=True, fp8=True),
    "sub": dict(compile="sub", cuda_graphs=False, prune_last=True),
    "layer": dict(compile="layer", cuda_graphs=False, prune_last=False),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = tiny.write(tmp_path_factory.mktemp("small") / "small", size="small")
    return {dtype: checkpoint.load(path, device="cuda", dtype=dtype, max_prompt_tokens=MAX_PROMPT)
            for dtype in ("bfloat16", "float32")}


@pytest.fixture(scope="module")
def prompts(models):
    rng = random.Random(0)
    encoder = Encoder(models["bfloat16"])
    requests = []
    for k in (1, 2, 3, 5, 8, 11, 2, 9, 4, 6, 10, 7, 1, 3, 11, 9):
        names = rng.sample(sorted(QUESTIONS), rng.randint(1, 3))
        state = " ".join(rng.choice(tiny.CORPUS) for _ in range(k))
        requests.append({"state": state, "questions": {n: QUESTIONS[n] for n in names}})
    for colors, size in [(("red",), (64, 64)), (("blue", "green"), (96, 32)), (("white",), (160, 96))]:
        assets = {f"img-{i}": {"data_base64": png(c, size)} for i, c in enumerate(colors)}
        requests.append({"state": "Look: " + ", ".join(assets) + ". " + tiny.CORPUS[5], "questions": QUESTIONS,
                         "assets": assets})
    planned = [encoder.prompts(Request.model_validate(r)) for r in requests]
    assert any(len(p) > 1 for p in planned), "some requests must span several prompts"
    return [prompt for plan in planned for prompt in plan]


def probabilities(model, prompts, scores) -> list[torch.Tensor]:
    temperature = model.decision_config.temperature
    out = []
    for prompt, rows in zip(prompts, scores):
        for question, logits in zip(prompt.questions, option_logits(model, prompt.questions, rows)):
            out.append(torch.softmax(torch.tensor(logits, dtype=torch.float64) / temperature.get(question.type, 1.0),
                                     dim=-1))
    return out


def differences(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    """Per question, the largest probability difference between two runs of the same questions."""
    return [float((x - y).abs().max()) for x, y in zip(a, b, strict=True)]


def compare(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    """Largest probability difference and argmax flip rate between two runs of the same questions."""
    flips = sum(int(x.argmax() != y.argmax()) for x, y in zip(a, b, strict=True)) / len(a)
    return max(differences(a, b)), flips


def greedy_packs(prompts, budget, order=None):
    order = list(range(len(prompts))) if order is None else order
    packs, current, used = [], [], 0
    for i in order:
        if current and used + prompts[i].length > budget:
            packs.append(current)
            current, used = [], 0
        current.append(i)
        used += prompts[i].length
    return packs + [current] if current else packs


def run_packs(engine, prompts, packs) -> list[torch.Tensor]:
    scores: list[torch.Tensor | None] = [None] * len(prompts)
    pending = [(pack, engine.launch([prompts[i] for i in pack])) for pack in packs]  # launched before waiting
    for pack, run in pending:
        for i, rows in zip(pack, run.wait().scores):
            scores[i] = rows
    assert all(s is not None for s in scores)
    return scores


@pytest.fixture(scope="module")
def references(models, prompts):
    out = {dtype: probabilities(models["bfloat16"], prompts, ReferenceEngine(model).forward(prompts))
           for dtype, model in models.items()}
    diff, flips = compare(out["bfloat16"], out["float32"])
    report(test="reference", dtype="bf16", vs="fp32", max_prob_diff=diff, flip_rate=flips,
           questions=len(out["float32"]))
    out["bf16_error"], out["bf16_flips"] = diff, flips
    return out


def engine_for(models, **fields) -> FastEngine:
    # deterministic mode (on by default on Hopper) has its own tests (test_bitwise.py): these hold the other
    engine = FastEngine(models["bfloat16"], Settings(buckets=BUCKETS, pack_tokens=2048,
                                                     **{"deterministic": False, **fields}))
    engine.warmup()
    return engine


@pytest.fixture(scope="module")
def engines(models):
    """Each configuration's engine, built (compiled, captured, warmed up) once for every test of the module."""
    built: dict[str, FastEngine] = {}

    def get(name: str) -> FastEngine:
        if name not in built:
            built[name] = engine_for(models, **CONFIGS[name])
        return built[name]

    return get


@pytest.mark.parametrize("name", ["eager", "layer+graphs+prune"])
def test_results_do_not_depend_on_the_pack(engines, models, prompts, references, name):
    """The same prompts alone, in full packs, in reverse and shuffled half-full packs, over different buckets."""
    engine = engines(name)
    model = models["bfloat16"]
    base = probabilities(model, prompts, run_packs(engine, prompts, greedy_packs(prompts, 2048)))
    order = list(range(len(prompts)))
    random.Random(1).shuffle(order)
    compositions = {
        "alone": [[i] for i in range(len(prompts))],
        "reversed": greedy_packs(prompts, 2048, order[::-1]),
        "shuffled-half": greedy_packs(prompts, 1024, order),
    }
    worst = 0.0
    for label, packs in compositions.items():
        diff, flips = compare(probabilities(model, prompts, run_packs(engine, prompts, packs)), base)
        report(test="composition", config=name, composition=label, vs="full packs", max_prob_diff=diff,
               flip_rate=flips)
        worst = max(worst, diff)
    assert worst <= references["bf16_error"] + 0.02


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fast_path_equals_the_reference(engines, models, prompts, references, name):
    engine = engines(name)
    fp8 = CONFIGS[name].get("fp8", False)
    assert engine.fwd.fp8_matrices > 0 if fp8 else engine.fwd.fp8_matrices == 0
    got = probabilities(models["bfloat16"], prompts, run_packs(engine, prompts, greedy_packs(prompts, 2048)))
    diff, flips = compare(got, references["float32"])
    diff16, flips16 = compare(got, references["bfloat16"])
    mean = sum(differences(got, references["float32"])) / len(got)
    report(test="fast", config=name, vs="fp32", max_prob_diff=diff, mean_prob_diff=mean, flip_rate=flips,
           vs_bf16_max_prob_diff=diff16, vs_bf16_flip_rate=flips16, warmup_s=round(engine.compile_seconds, 1),
           capture_s=round(engine.capture_seconds, 1))
    error, flipped = references["bf16_error"], references["bf16_flips"]
    if fp8:
        assert mean <= 0.1 and flips <= flipped + 0.15
    else:
        assert diff <= 2 * error + 0.02 and flips <= flipped + 0.05


def test_without_fla_the_error_names_the_reference_engine(models, monkeypatch):
    import sys

    from worker.fast import FastPathUnavailable

    monkeypatch.setitem(sys.modules, "fla", None)
    monkeypatch.setitem(sys.modules, "fla.ops", None)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", None)
    with pytest.raises(FastPathUnavailable, match="flash-linear-attention.*reference"):
        FastEngine(models["bfloat16"], Settings(deterministic=False))  # the mode's switches are the process's
