"""`swiftlm rollout` (vLLM behind a server) and trainers using it (`--vllm_mode server`), on a
tiny model in float32.

- A weight push is real: after pushing a different model's weights, the server's greedy
  answers are that model's (swiftlm's own engine over it gives the same tokens), not the
  served one's, and its scaled log-probs are within 1e-4 of the engine's (float32 on both
  sides: ~1e-6 relative on logits of magnitude ~10).
- The server's bad-input contract: unknown fields, ids outside the vocabulary, calls out of
  order are 4xx naming the problem, and the server keeps serving.
- A 10-step GRPO LoRA run with its rollouts on the server keeps the logged mismatch below
  1e-3 (as colocate mode, test_vllm_grpo.py); a GKD run samples its student there.

These run where vLLM installs: `bash scripts/setup_vllm.sh`, then
`.venv-vllm/bin/python -m pytest -m vllm` (.ci/run does both).
"""

import sys
from types import SimpleNamespace

import httpx
import pytest
from serve_helpers import free_port, server_output, start_server_process

from conftest import build_tokenizer, logged, make_tiny_llama, write_jsonl
from swiftlm.cli.main import main
from swiftlm.engine.protocol import GenerationRequest, SamplingParams
from vllm_helpers import VLLM_ENV, VLLM_MISSING, build_vllm_model

pytest.importorskip("vllm", reason=VLLM_MISSING)
pytestmark = pytest.mark.vllm
MISMATCH_BOUND = 1e-3
PROMPTS = [[5, 17, 30, 2 + i] for i in range(4)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm_model")
    build_vllm_model(folder, tmp_path_factory.mktemp("unused_lora"))
    return folder


@pytest.fixture(scope="module")
def server(model):
    port, group_port = free_port(), free_port()
    command = [sys.executable, "-m", "swiftlm", "rollout", "--model", str(model)]
    command += ["--port", str(port), "--torch_dtype", "float32", "--vllm_enforce_eager", "true"]
    command += ["--max_model_len", "128"]
    url = f"http://127.0.0.1:{port}"
    process = start_server_process(command, VLLM_ENV, url, "swiftlm rollout")
    yield SimpleNamespace(url=url, port=port, group_port=group_port)
    process.terminate()
    process.wait(timeout=60)
    output = server_output(process)
    assert process.returncode == 0, output
    assert "terminate called" not in output, output


def _sampler(server, tokenizer):
    from swiftlm.methods.rl.vllm_server import VllmServerSampler

    args = SimpleNamespace(
        vllm_server_host="127.0.0.1",
        vllm_server_port=server.port,
        vllm_group_port=server.group_port,
        vllm_server_timeout=120.0,
    )
    return VllmServerSampler(tokenizer, args)


def _greedy() -> list[GenerationRequest]:
    params = SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, logprobs=True, logprobs_mode="scaled"
    )
    return [GenerationRequest(list(p), params) for p in PROMPTS]


def test_pushed_weights_are_the_ones_the_server_samples_from(server, model, tmp_path):
    from swiftlm.methods.rl.rollout import PolicySampler

    tokenizer = build_tokenizer(tmp_path / "tokenizer")
    served = httpx.post(
        f"{server.url}/generate/",
        json={"requests": [{"prompt_ids": p, "params": {"max_tokens": 8, "temperature": 0,
                                                        "ignore_eos": True}} for p in PROMPTS]},
        timeout=120,
    ).json()["results"]  # fmt: skip
    other = make_tiny_llama(len(tokenizer), seed=7, hidden_size=256).eval()
    sampler = _sampler(server, tokenizer)
    try:
        pushed = sampler.generate(other, _greedy())
        reference = PolicySampler(tokenizer, 128).generate(other, _greedy())
        assert sampler.syncs == 1
    finally:
        sampler.close()
    for after, ref in zip(pushed, reference, strict=True):
        assert after[0].token_ids == ref[0].token_ids
        for ours, theirs in zip(after[0].logprobs, ref[0].logprobs, strict=True):
            assert abs(ours.logprob - theirs.logprob) < 1e-4
    assert any(b[0]["token_ids"] != a[0].token_ids for b, a in zip(served, pushed, strict=True))


@pytest.mark.bad_input(
    input="`swiftlm rollout`: a call with a missing, unknown or out-of-range field, prompt ids "
    "outside the vocabulary, or weight-sync calls out of order",
    outcome="400 naming the field (or the request), 409 naming the call to make first; the "
    "server keeps serving",
)
@pytest.mark.parametrize(
    ("path", "body", "status", "says"),
    [
        ("/generate/", {}, 400, "'requests' is required"),
        ("/generate/", {"requests": [{"prompt_ids": [1], "params": {"temp": 1}}]}, 400,
         "params.temp is not a sampling field"),
        ("/generate/", {"requests": [{"prompt_ids": [10**6]}]}, 400, "requests[0]"),
        ("/generate/", {"requests": [{"prompt_ids": [1], "params": {"top_p": 0}}]}, 400,
         "top_p"),
        ("/weights/update/", {"buckets": [[{"name": "x", "shape": [1], "dtype": "float32"}]]},
         409, "POST /weights/init/ first"),
        ("/weights/wait/", None, 409, "no weight-sync call is pending"),
        ("/weights/init/", {"group_port": 0, "trainer_device": "cpu"}, 400, "group_port"),
    ],
)  # fmt: skip
def test_bad_calls_are_refused_by_name(server, path, body, status, says):
    answer = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert answer.status_code == status, answer.text
    assert says in answer.json()["error"]["message"]
    assert httpx.get(f"{server.url}/info/", timeout=10).json()["vocab_size"] > 0


ROWS = [{"prompt": f"What is {i} plus {i + 1}?", "solution": str(2 * i + 1)} for i in range(16)]
SHORT_REWARD = """
def short(prompts, completions, completion_ids, **kwargs):
    return [-len(ids) / 8 for ids in completion_ids]
"""


def _rlhf(model, server, tmp_path, method: list[str]):
    data = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    out = tmp_path / "run"
    argv = ["rlhf", *method, "--model", str(model), "--dataset", str(data)]
    argv += ["--output_dir", str(out), "--torch_dtype", "float32", "--report_to", "none"]
    argv += ["--logging_steps", "1", "--max_completion_length", "8", "--max_length", "64"]
    argv += ["--learning_rate", "5e-3", "--lora_dropout", "0", "--save_steps", "100"]
    argv += ["--infer_backend", "vllm", "--vllm_mode", "server"]
    argv += ["--vllm_server_port", str(server.port), "--vllm_group_port", str(server.group_port)]
    assert main(argv) == 0
    return out


def _grpo(model, server, tmp_path):
    reward = tmp_path / "short.py"
    reward.write_text(SHORT_REWARD)
    grpo = ["--rlhf_type", "grpo", "--reward_funcs", f"{reward}:short", "--max_steps", "10"]
    grpo += ["--per_device_train_batch_size", "8", "--num_generations", "4"]
    return _rlhf(model, server, tmp_path, grpo)


def test_grpo_on_the_server_keeps_it_on_the_policy(model, server, tmp_path):
    run = _grpo(model, server, tmp_path)
    mismatch = logged(run, "logprob_mismatch")
    assert len(mismatch) == 10 and max(mismatch) < MISMATCH_BOUND
    weights = logged(run, "tis_weight")
    assert len(weights) == 10 and all(abs(w - 1) < 10 * MISMATCH_BOUND for w in weights)


def test_without_the_pushes_the_server_falls_behind(model, server, tmp_path, monkeypatch):
    """The mutation the test above guards against: only the first step's weights reach the
    server."""
    from swiftlm.methods.rl.vllm_server import VllmServerSampler

    push = VllmServerSampler._push
    monkeypatch.setattr(
        VllmServerSampler, "_push", lambda self, policy: self.syncs or push(self, policy)
    )
    mismatch = logged(_grpo(model, server, tmp_path), "logprob_mismatch")
    assert mismatch[0] < MISMATCH_BOUND and max(mismatch[5:]) > 10 * MISMATCH_BOUND


def _served_requests(server) -> float:
    """The server's count of generation requests (/metrics)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith("swiftlm_requests_total{")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if 'endpoint="generate"' in line)


def test_gkd_samples_its_student_on_the_server(model, server, tmp_path):
    gkd = ["--rlhf_type", "gkd", "--teacher_model", str(model), "--lmbda", "1"]
    gkd += ["--max_steps", "3", "--per_device_train_batch_size", "4"]
    before = _served_requests(server)
    run = _rlhf(model, server, tmp_path, gkd)
    assert len(logged(run, "loss")) == 3 and (run / "final" / "adapter_model.safetensors").is_file()
    assert _served_requests(server) - before == 3 * 4  # every step on-policy, on the server
