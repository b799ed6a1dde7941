"""`swiftlm deploy` with a vision-language model (the tiny random LLaVA of vlm_helpers), called
with the real `openai` client: images as base64 data URLs and http URLs, whole and streamed
answers equal to the local `swiftlm infer` answer and to transformers' own generate; bad
images, local paths and image parts sent to a text-only model are 400s naming the part."""

import base64
import functools
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from serve_helpers import ServerThread, SlowEngine, free_port  # noqa: E402

from swiftlm.checkpoint.resolve import resolve_inference_model  # noqa: E402
from swiftlm.config import InferConfig  # noqa: E402
from swiftlm.engine.config import GenerationArguments  # noqa: E402
from swiftlm.infer.chat_images import question_content  # noqa: E402
from swiftlm.infer.frontend import build_chat_engine  # noqa: E402
from swiftlm.models.config import ModelArguments  # noqa: E402
from vlm_helpers import build_llava, write_picture  # noqa: E402

NEW_TOKENS = 8
QUESTION = "What colour is this?"


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    return build_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def picture(tmp_path_factory) -> Path:
    return write_picture(tmp_path_factory.mktemp("pictures") / "red.png", (220, 20, 20))


def data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def image_message(url: str, text: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module")
def server(llava, tmp_path_factory):
    """A real `swiftlm deploy` process on the tiny LLaVA: (base url, its output so far)."""
    port = free_port()
    env = {**os.environ, "SWIFTLM_CACHE": str(tmp_path_factory.mktemp("cache"))}
    command = [sys.executable, "-m", "swiftlm.cli.main", "deploy", "--model", str(llava)]
    process = subprocess.Popen(
        [*command, "--port", str(port), "--served_model_name", "llava"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert process.poll() is None, process.stdout.read()
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "swiftlm deploy did not start"
        time.sleep(0.5)
    yield url, process
    os.killpg(process.pid, signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    # The startup says which backend generates: continuous batching is text-only.
    assert "continuous batching is text-only" in process.stdout.read()


@pytest.fixture(scope="module")
def local_engine(llava):
    """The VisionChatEngine of `swiftlm infer --model <llava>`."""
    cfg = InferConfig(model=ModelArguments(model=str(llava)))
    engine = build_chat_engine(resolve_inference_model(cfg), cfg.model, seed=42)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def local_answer(local_engine, picture):
    """What `swiftlm infer` answers, greedy, to QUESTION on the picture."""
    conversation = [{"role": "user", "content": question_content(QUESTION, [str(picture)])}]
    gen = GenerationArguments(max_new_tokens=NEW_TOKENS, temperature=0.0)
    return local_engine.generate([conversation], gen)[0]


def transformers_answer(llava: Path, picture: Path) -> str:
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(llava)
    model = AutoModelForImageTextToText.from_pretrained(llava, dtype=torch.float32).eval()
    text = f"<|im_start|>user\n<image>{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    image = Image.open(picture).convert("RGB")
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    ids = out[0, inputs["input_ids"].shape[1] :]
    return processor.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_a_data_url_image_is_answered_as_locally_and_as_transformers(
    server, llava, picture, local_answer
):
    url, process = server
    reply = client(url).chat.completions.create(
        model="llava", messages=image_message(data_url(picture)), temperature=0, max_tokens=8
    )
    answer = reply.choices[0].message.content
    assert answer == local_answer
    assert answer == transformers_answer(llava, picture)
    assert reply.usage.prompt_tokens > 10  # the image's tokens count as prompt tokens

    # Streamed: the same text, piece by piece.
    stream = client(url).chat.completions.create(
        model="llava",
        messages=image_message(data_url(picture)),
        temperature=0,
        max_tokens=8,
        stream=True,
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(pieces) == answer


def test_an_http_image_and_a_text_only_request(server, picture, local_answer):
    url, _ = server
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(picture.parent))
    handler.log_message = lambda *args: None
    images = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=images.serve_forever, daemon=True).start()
    try:
        image_url = f"http://127.0.0.1:{images.server_address[1]}/{picture.name}"
        reply = client(url).chat.completions.create(
            model="llava", messages=image_message(image_url), temperature=0, max_tokens=8
        )
        assert reply.choices[0].message.content == local_answer
    finally:
        images.shutdown()
    text_only = client(url).chat.completions.create(
        model="llava",
        messages=[{"role": "user", "content": "Say hello."}],
        temperature=0,
        max_tokens=8,
    )
    assert text_only.choices[0].finish_reason in ("stop", "length")


@pytest.mark.bad_input(
    input="An image_url part that is not base64, not an image, a server path, or asks logprobs",
    outcome="HTTP 400 naming messages[i].content[j] and the fix; never a 500",
)
def test_bad_images_are_400s_naming_the_part(server, picture):
    url, _ = server
    endpoint = f"{url}/v1/chat/completions"

    def post(messages: list[dict], **extra) -> httpx.Response:
        body = {"model": "llava", "messages": messages, "max_tokens": 4, **extra}
        return httpx.post(endpoint, json=body, timeout=60)

    not_base64 = [
        {"role": "user", "content": "Hi"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}},
            ],
        },
    ]
    reply = post(not_base64)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert "messages[1].content[1]" in error["message"] and "invalid base64" in error["message"]
    assert error["param"] == "messages.1.content.1"

    garbage = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()
    reply = post(image_message(garbage))
    assert reply.status_code == 400
    assert "messages[0].content[0]" in reply.json()["error"]["message"]
    assert "not an image PIL can read" in reply.json()["error"]["message"]

    reply = post(image_message(str(picture)))  # a path on the server: refused by default
    assert reply.status_code == 400
    assert "--allow_local_images" in reply.json()["error"]["message"]

    reply = post(image_message(data_url(picture)), logprobs=True)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "logprobs"

    # The server is still serving.
    assert post(image_message(data_url(picture))).status_code == 200


def test_image_parts_for_a_text_only_model_are_a_400(tiny_tokenizer, picture):
    from swiftlm.serve.app import ServerSettings, generation_app
    from swiftlm.serve.translate import ServedModels

    engine = SlowEngine(token_id=5)
    app = generation_app(engine, tiny_tokenizer, ServedModels("tiny"), ServerSettings())
    try:
        with ServerThread(app) as url:
            body = {"model": "tiny", "messages": image_message(data_url(picture))}
            reply = httpx.post(f"{url}/v1/chat/completions", json=body)
            assert reply.status_code == 400
            error = reply.json()["error"]
            assert "'messages[0].content[0]' is an image" in error["message"]
            assert "text-only" in error["message"] and "vision-language model" in error["message"]
            # Text parts alone still work.
            body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
            body["max_tokens"] = 2
            assert httpx.post(f"{url}/v1/chat/completions", json=body).status_code == 200
    finally:
        engine.shutdown()


def test_local_paths_are_read_only_with_the_opt_in(local_engine, local_answer, picture):
    from swiftlm.serve.app import ServerSettings, generation_app
    from swiftlm.serve.translate import ServedModels

    engine = local_engine.engine
    for allowed in (False, True):
        settings = ServerSettings(allow_local_images=allowed)
        app = generation_app(engine, engine.tokenizer, ServedModels("llava"), settings)
        with ServerThread(app) as url:
            for reference in (str(picture), f"file://{picture}"):
                body = {
                    "model": "llava",
                    "messages": image_message(reference),
                    "temperature": 0,
                    "max_tokens": NEW_TOKENS,
                }
                reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
                if allowed:
                    assert reply.status_code == 200, reply.text
                    assert reply.json()["choices"][0]["message"]["content"] == local_answer
                else:
                    assert reply.status_code == 400
                    assert "--allow_local_images" in reply.json()["error"]["message"]
