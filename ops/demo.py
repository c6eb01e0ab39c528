"""The demo: an embedded Redis, a tiny checkpoint, one worker process and a producer; answers printed.

The checkpoint is random, so the answers are arbitrary; what the demo shows is the path: requests enqueued as
JSON, packed and scored by a worker, one result per request read back, errors for bad input. Nothing is kept:
its temporary directory is removed at the end.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from producer.client import Client  # noqa: E402
from producer.local.ports import free_port  # noqa: E402
from producer.local.server import RedisServer  # noqa: E402

QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Does the customer ask for a refund?"},
    "tone": {"type": "choice", "instructions": "What is the tone?",
             "criteria": {"calm": "Polite and patient", "angry": "Upset or hostile", "pushy": None}},
    "urgency": {"type": "score", "instructions": "How urgent is it?", "criteria": ["Can wait", "This week", "Today"]},
}
STATES = [
    "I was charged twice for my order and want a refund.",
    "WIN a FREE phone, click here now!",
    {"message": "The parcel arrived damaged. Please send a new one today.", "customer": {"plan": "pro"}},
]


def picture() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), "red").save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


NOTICE = ("demo: a tiny checkpoint with RANDOM weights serves these requests, so its answers are arbitrary: the "
          "demo shows the path (enqueue, pack, score, one result per request, errors for bad input), not a model's "
          "judgement. Serve a trained checkpoint with dq-worker serve --checkpoint DIR (README).")


def main() -> int:
    print(NOTICE, flush=True)
    work = Path(tempfile.mkdtemp(prefix="dq-demo-"))
    try:  # the checkpoint and the server's files: removed however the demo ends (Ctrl-C included)
        return run(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(work: Path) -> int:
    checkpoint = work / "tiny-checkpoint"
    print("demo: writing the tiny checkpoint...", flush=True)
    subprocess.run([sys.executable, "-m", "worker", "tiny-checkpoint", str(checkpoint)], check=True, cwd=ROOT)
    with RedisServer() as redis_server:
        where = "embedded" if redis_server.found.embedded else redis_server.binary
        print(f"{redis_server.server} ({where}) on {redis_server.url}")
        port = free_port()
        print("demo: starting a worker (it loads the model first)...", flush=True)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        worker = subprocess.Popen([sys.executable, "-m", "worker", "serve", "--checkpoint", str(checkpoint),
                                   "--redis-url", redis_server.url, "--metrics-port", str(port)], cwd=ROOT, env=env)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1)
                    break
                except OSError:
                    if worker.poll() is not None or time.monotonic() > deadline:
                        print("the worker did not become ready", file=sys.stderr)
                        return 1
                    time.sleep(0.2)
            client = Client(redis_server.url)
            requests = [{"state": state, "questions": QUESTIONS} for state in STATES]
            requests.append({"state": "What is in img-1?", "assets": {"img-1": {"type": "image", "format": "png",
                                                                                "data_base64": picture()}},
                             "questions": {"red": {"type": "noul", "instructions": "Is the picture red?"}}})
            requests.append({"id": "bad-request", "state": "x", "questions": {"q": {"type": "choice", "criteria": {
                f"option-{i}": None for i in range(20)}}}})
            ids = client.submit_many(requests)
            results = client.wait_many(ids, timeout=120)
            for request, request_id in zip(requests, ids):
                result = results[request_id]
                print(f"\n{request_id}  state: {str(request['state'])[:70]}")
                if not result.ok:
                    print(f"  error {result.error.code.value}: {result.error.message}")
                    continue
                for name, answer in result.answers.items():
                    shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in answer.items()
                             if k not in ("legend", "probabilities")}
                    probs = [round(p, 3) for p in result.probabilities[name]]
                    print(f"  {name:8s} {shown}  probabilities {dict(zip(result.options[name], probs))}")
                print(f"  usage {result.usage.model_dump()}  compute {result.timings.compute_ms} ms")
            print("\nqueue:", client.stats())
            print(f"\n{NOTICE}")
        finally:
            worker.terminate()
            worker.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
