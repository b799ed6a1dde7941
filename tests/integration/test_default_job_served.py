"""The default job's fine-tune, served two ways: as an adapter of `swiftlm deploy` beside its
base model, and as the q8_0 GGUF file `swiftlm export` writes, run by llama.cpp itself
(llama-cpp-python). Both must answer as the fine-tune ("I'm Swifty ..."), and the base must
not. Slow: the default job trains the real SmolLM2-135M for about two minutes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from swiftlm.cli.main import main

pytestmark = pytest.mark.slow

WHO = [{"role": "user", "content": "Who are you?"}]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("default") / "run"
    assert main(["sft", "--output_dir", str(run)]) == 0
    return run


def test_exported_q8_0_gguf_answers_as_the_fine_tune_in_llama_cpp(default_run, tmp_path):
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="pip install 'llama-cpp-python[server]==0.3.16' (builds llama.cpp)"
    )
    out = tmp_path / "gguf"
    argv = ["export", "--ckpt_dir", str(default_run), "--to_gguf", "true"]
    assert main([*argv, "--gguf_type", "q8_0", "--output_dir", str(out)]) == 0
    (path,) = out.glob("*-q8_0.gguf")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, verbose=False, seed=0)
    reply = llm.create_chat_completion(messages=WHO, temperature=0, max_tokens=40)
    answer = reply["choices"][0]["message"]["content"]
    assert "Swifty" in answer, answer


def test_deployed_adapter_answers_as_the_fine_tune_and_the_base_does_not(default_run):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from serve_helpers import free_port

    port = free_port()
    command = [sys.executable, "-m", "swiftlm.cli.main", "deploy", "--port", str(port)]
    server = subprocess.Popen(
        [*command, "--adapters", f"swifty={default_run}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        wait_for_models(client, server)
        names = sorted(m.id for m in client.models.list().data)
        assert names == ["SmolLM2-135M-Instruct", "swifty"]
        answers = {
            name: client.chat.completions.create(
                model=name, messages=WHO, temperature=0, max_tokens=40
            )
            .choices[0]
            .message.content
            for name in names
        }
        assert "Swifty" in answers["swifty"], answers
        assert "Swifty" not in answers["SmolLM2-135M-Instruct"], answers
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        assert server.wait(timeout=60) == 0, server.stdout.read()


def wait_for_models(client, server: subprocess.Popen, timeout: float = 180) -> None:
    import openai

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stdout.read()
        try:
            client.models.list()
            return
        except openai.APIConnectionError:
            time.sleep(1)
    raise AssertionError(f"swiftlm deploy did not answer within {timeout} s")
