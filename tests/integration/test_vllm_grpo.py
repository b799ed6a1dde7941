"""GRPO with its rollouts on vLLM (`--infer_backend vllm`, colocate): a 10-step LoRA run on a
tiny model in float32, where the policy changes every step. vLLM's weights are reloaded from
the policy before every generation, so its log-probs of what it sampled stay those of the
policy being trained: the logged mismatch stays below 1e-3 per token (float32 on both sides:
~1e-6 relative on logits of magnitude ~10, summed over a 256-wide hidden state, far below
1e-3: measured ~3e-6). Without the reload the engine samples from the first step's weights
and the mismatch grows to 0.2-0.6 within 10 steps at this learning rate, as the second test
shows.

These run where vLLM installs: `bash scripts/setup_vllm.sh`, then
`.venv-vllm/bin/python -m pytest -m vllm` (.ci/run does both).
"""

import pytest

from conftest import logged, write_jsonl
from swiftlm.cli.main import main
from vllm_helpers import VLLM_ENV, VLLM_MISSING, build_vllm_model

pytest.importorskip("vllm", reason=VLLM_MISSING)
pytestmark = pytest.mark.vllm
MISMATCH_BOUND = 1e-3
ROWS = [{"prompt": f"What is {i} plus {i + 1}?", "solution": str(2 * i + 1)} for i in range(16)]
SHORT_REWARD = """
def short(prompts, completions, completion_ids, **kwargs):
    return [-len(ids) / 8 for ids in completion_ids]
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm_model")
    build_vllm_model(folder, tmp_path_factory.mktemp("unused_lora"))
    return folder


def _grpo(model, tmp_path, *flags) -> list:
    data = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    reward = tmp_path / "short.py"
    reward.write_text(SHORT_REWARD)
    out = tmp_path / "run"
    argv = ["rlhf", "--rlhf_type", "grpo", "--model", str(model), "--dataset", str(data)]
    argv += ["--output_dir", str(out), "--torch_dtype", "float32", "--report_to", "none"]
    argv += ["--logging_steps", "1", "--per_device_train_batch_size", "8"]
    argv += ["--num_generations", "4", "--max_completion_length", "8", "--max_length", "64"]
    argv += ["--max_steps", "10", "--learning_rate", "5e-3", "--lora_dropout", "0"]
    argv += ["--reward_funcs", f"{reward}:short", "--save_steps", "100"]
    argv += ["--infer_backend", "vllm", "--vllm_enforce_eager", "true", *flags]
    assert main(argv) == 0
    return out


def test_a_grpo_run_on_vllm_keeps_the_engine_on_the_policy(model, tmp_path, monkeypatch):
    for name, value in VLLM_ENV.items():
        monkeypatch.setenv(name, value)
    run = _grpo(model, tmp_path)
    mismatch = logged(run, "logprob_mismatch")
    assert len(mismatch) == 10 and max(mismatch) < MISMATCH_BOUND
    weights = logged(run, "tis_weight")  # exp(mismatch) ~ 1, never past the cap
    assert len(weights) == 10 and all(abs(w - 1) < 10 * MISMATCH_BOUND for w in weights)
    assert logged(run, "loss") and (run / "final" / "adapter_model.safetensors").is_file()


def test_without_the_reload_the_engine_falls_behind(model, tmp_path, monkeypatch):
    """The mutation the first test guards against: vLLM keeps the first step's weights."""
    from swiftlm.engine.vllm_backend import VllmEngine

    for name, value in VLLM_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(VllmEngine, "reload_weights", lambda self, folder: None)
    mismatch = logged(_grpo(model, tmp_path), "logprob_mismatch")
    assert mismatch[0] < MISMATCH_BOUND and max(mismatch[5:]) > 10 * MISMATCH_BOUND


def test_gkd_samples_its_student_on_vllm(model, tmp_path, monkeypatch):
    """GKD's on-policy steps (every step at --lmbda 1) sample the student on vLLM, its
    weights synced before each."""
    from swiftlm.methods.rl.vllm_rollout import VllmPolicySampler

    for name, value in VLLM_ENV.items():
        monkeypatch.setenv(name, value)
    synced = []
    sync = VllmPolicySampler._sync
    monkeypatch.setattr(
        VllmPolicySampler, "_sync", lambda self, policy: synced.append(1) or sync(self, policy)
    )
    data = write_jsonl(tmp_path / "prompts.jsonl", ROWS)
    out = tmp_path / "run"
    argv = ["rlhf", "--rlhf_type", "gkd", "--teacher_model", str(model), "--lmbda", "1"]
    argv += ["--model", str(model), "--dataset", str(data), "--output_dir", str(out)]
    argv += ["--torch_dtype", "float32", "--report_to", "none", "--logging_steps", "1"]
    argv += ["--per_device_train_batch_size", "4", "--max_completion_length", "8"]
    argv += ["--max_length", "64", "--max_steps", "3", "--save_steps", "100"]
    argv += ["--infer_backend", "vllm", "--vllm_enforce_eager", "true"]
    assert main(argv) == 0
    assert len(synced) == 3 and len(logged(out, "loss")) == 3
