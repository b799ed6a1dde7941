"""`--infer_backend vllm` through the commands a user runs: `swiftlm deploy` called with the
real openai client (streaming, n, stop, log-probs, a LoRA adapter, and swiftlm's API layer:
auth, 400s, /metrics), and `swiftlm infer` / `swiftlm eval` giving the answers swiftlm's own
engine gives (greedy, float32).

These run where vLLM installs: `bash scripts/setup_vllm.sh`, then
`.venv-vllm/bin/python -m pytest -m vllm` (.ci/run does both).
"""

import json
import sys

import httpx
import pytest
from serve_helpers import free_port, start_server_process

from conftest import write_jsonl
from swiftlm.cli.main import main
from vllm_helpers import VLLM_ENV, VLLM_MISSING, build_vllm_model

pytest.importorskip("vllm", reason=VLLM_MISSING)
pytestmark = pytest.mark.vllm
KEY = "sk-test"
VLLM_FLAGS = ["--infer_backend", "vllm", "--vllm_enforce_eager", "true"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder, adapter = tmp_path_factory.mktemp("vllm_model"), tmp_path_factory.mktemp("lora")
    build_vllm_model(folder, adapter)
    return folder, adapter


@pytest.fixture(scope="module")
def server(model):
    """`swiftlm deploy` on vLLM, the adapter served as "a", behind an API key."""
    folder, adapter = model
    port = free_port()
    command = [sys.executable, "-m", "swiftlm", "deploy", "--model", str(folder), *VLLM_FLAGS]
    command += ["--port", str(port), "--served_model_name", "tiny", "--api_key", KEY]
    command += ["--adapters", f"a={adapter}", "--torch_dtype", "float32"]
    command += ["--max_model_len", "256"]
    url = f"http://127.0.0.1:{port}"
    what = "swiftlm deploy --infer_backend vllm"
    process = start_server_process(command, VLLM_ENV, url, what)
    yield url
    process.terminate()
    assert process.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


def _chat(client, model="tiny", **fields):
    fields.setdefault("max_tokens", 10)
    fields.setdefault("temperature", 0)
    messages = [{"role": "user", "content": "Name three colors."}]
    return client.chat.completions.create(model=model, messages=messages, **fields)


def test_the_openai_client_gets_answers_streams_and_samples(client):
    assert {m.id for m in client.models.list().data} == {"tiny", "a"}
    whole = _chat(client, extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10
    stream = _chat(client, stream=True, extra_body={"ignore_eos": True})
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == whole.choices[0].message.content
    sampled = _chat(client, n=3, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    again = _chat(client, n=3, temperature=1.0, seed=5, extra_body={"ignore_eos": True})
    texts = [c.message.content for c in sampled.choices]
    assert [c.index for c in sampled.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices] and len(set(texts)) > 1


def test_stop_logprobs_and_the_adapter(client):
    whole = _chat(client, max_tokens=16, extra_body={"ignore_eos": True})
    text = whole.choices[0].message.content
    stop = text[len(text) // 2 :][:3]
    cut = _chat(client, max_tokens=16, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]
    scored = _chat(client, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    tokens = scored.choices[0].logprobs.content
    assert len(tokens) == 10 and all(len(t.top_logprobs) == 2 for t in tokens)
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in tokens)  # greedy
    adapted = _chat(client, model="a", extra_body={"ignore_eos": True})
    assert adapted.choices[0].message.content != text[: len(adapted.choices[0].message.content)]


def test_swiftlm_s_api_layer_stands_in_front_of_vllm(server, client):
    import openai

    with pytest.raises(openai.BadRequestError, match="temperature"):
        _chat(client, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
        _chat(client, max_tokens=1000)
    with pytest.raises(openai.NotFoundError):
        _chat(client, model="nope")
    anonymous = httpx.post(f"{server}/v1/chat/completions", json={"model": "tiny"})
    assert anonymous.status_code == 401
    metrics = httpx.get(f"{server}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    assert "swiftlm_prefill_tokens_total" in metrics and "swiftlm_prefix" in metrics


def _infer(folder, rows, out, *backend):
    argv = ["infer", "--model", str(folder), "--val_dataset", str(rows), "--result_path"]
    argv += [str(out), "--temperature", "0", "--max_new_tokens", "12", "--torch_dtype"]
    assert main([*argv, "float32", *backend]) == 0
    return [json.loads(line)["response"] for line in out.read_text().splitlines()]


def test_infer_answers_as_swiftlm_s_engine_does(model, tmp_path, monkeypatch):
    for name, value in VLLM_ENV.items():
        monkeypatch.setenv(name, value)
    questions = ["Name three colors.", "Hello, how are you today?", "What is 2 + 2?"]
    rows = write_jsonl(tmp_path / "q.jsonl", [{"query": q} for q in questions])
    ours = _infer(model[0], rows, tmp_path / "pt.jsonl")
    theirs = _infer(model[0], rows, tmp_path / "vllm.jsonl", *VLLM_FLAGS)
    assert theirs == ours and all(ours)


def test_eval_scores_as_swiftlm_s_engine_does(model, tmp_path, monkeypatch):
    for name, value in VLLM_ENV.items():
        monkeypatch.setenv(name, value)
    qa = [{"query": "Name three colors.", "response": "red green blue"}] * 2
    data = write_jsonl(tmp_path / "qa.jsonl", qa)
    summaries = []
    for out, backend in (("pt", []), ("vllm", VLLM_FLAGS)):
        argv = ["eval", "--model", str(model[0]), "--eval_dataset", str(data)]
        argv += ["--max_new_tokens", "8", "--torch_dtype", "float32", *backend]
        assert main([*argv, "--eval_output_dir", str(tmp_path / out)]) == 0
        summaries.append(json.loads((tmp_path / out / "summary.json").read_text()))
        manifest = json.loads((tmp_path / out / "manifest.json").read_text())
        assert manifest["model"]["infer_backend"] == (out if backend else "pt")
    ours, theirs = (summary["tasks"]["qa"]["metrics"] for summary in summaries)
    assert theirs == ours and set(ours) >= {"exact_match", "rouge_l"}
    text = write_jsonl(tmp_path / "ppl.jsonl", [{"text": "some words to score"}])
    argv = ["eval", "--model", str(model[0]), "--eval_dataset", str(text), *VLLM_FLAGS]
    assert main([*argv, "--eval_output_dir", str(tmp_path / "ppl")]) == 2
