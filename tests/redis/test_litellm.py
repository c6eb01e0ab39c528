"""LiteLLM's System One API (``litellm.systemone`` and ``asystemone``, its ``typesafe/`` provider), a client nobody
here wrote, against the gateway as a service using LiteLLM calls it: sync and async, the state as text and as an
object, an image inline, a model nobody serves as LiteLLM's NotFoundError; each answer equal to the queue's own
for the same request. On the test run's gateway stack (tests/redis/gateways.py), a few calls, on one server (the
client's side does not depend on it). Skipped, saying so, where LiteLLM is not installed (the ``test`` extra
installs it)."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import pytest

from gateways import TOKENS
from producer.client import Client
from producer.local.binaries import servers_under_test

pytestmark = [pytest.mark.redis]
QUESTIONS = {"refund": {"type": "noul", "instructions": "Is a refund requested?"},
             "tone": {"type": "choice", "criteria": {"calm": None, "angry": "An upset message"}}}
# LiteLLM sends assets to the typesafe provider only where the call says the account takes images.
IMAGES = {"TypeSafe-Danger-Zone-Images": "true"}


@pytest.fixture
def gateway(request, server_binary):
    if server_binary.label != servers_under_test()[0].label:
        pytest.skip("LiteLLM's side does not depend on the server: one run")
    return request.getfixturevalue("stack")  # started only where it is used


@pytest.fixture(scope="module")
def litellm():
    """Imported by the test process that runs the test only (4 to 8 s), not by every one at collection. LiteLLM
    fetches its model price list from the internet at import unless told to use the copy it ships."""
    with pytest.MonkeyPatch.context() as patch:  # this module's alone: restored after it
        patch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        yield pytest.importorskip("litellm", reason="no litellm: pip install -e '.[test]' installs it")


def model_of(stack) -> str:
    [card] = httpx.get(stack.gateway.url + "/v1/models", headers={"Authorization": f"Bearer {TOKENS['acme']}"},
                       timeout=10).json()["models"]
    return card["name"]


def png() -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


def same(answer, expected: dict) -> None:
    dumped = answer.model_dump()
    for name in ("noul", "confidence"):
        if name in expected:
            assert dumped[name] == pytest.approx(expected[name], abs=1e-6), name
    if "choice" in expected:
        assert dumped["choice"] == expected["choice"]


def test_litellm_systemone_sync_async_and_an_image(gateway, litellm):
    model, where = model_of(gateway), {"api_base": gateway.gateway.url, "api_key": TOKENS["acme"]}
    image = png()
    calls = [{"state": "I was charged twice.", "questions": QUESTIONS},
             {"state": {"message": "Refund me", "channel": "email"}, "questions": QUESTIONS},
             {"state": "The parcel: IMG_1", "questions": {"red": {"type": "noul", "instructions": "Red?"}},
              "assets": {"IMG_1": {"type": "image", "format": "png", "data_base64": image}}}]
    sync = litellm.systemone(model=f"typesafe/{model}", **calls[0], **where)

    async def later() -> list:
        return await asyncio.gather(litellm.asystemone(model=f"typesafe/{model}", **calls[1], **where),
                                    litellm.asystemone(model=f"typesafe/{model}", **calls[2], **where,
                                                       extra_headers=IMAGES))

    answers = [sync, *asyncio.run(later())]
    with Client(gateway.server.url) as own:
        for call, response in zip(calls, answers):
            assert response.model == model and set(response.answers) == set(call["questions"])
            expected = own.decide(call, timeout=60).raise_for_error()
            assert response.usage.input_tokens == expected.usage.tokens
            for name, answer in response.answers.items():
                same(answer, expected.answers[name])
    with pytest.raises(litellm.NotFoundError, match="no live worker serves the model 'nobody'"):
        litellm.systemone(model="typesafe/nobody", **calls[0], **where)
