"""--train_type vera/loha/lokr/oft/boft/ia3, --init_weights pissa/olora and LISA on the tiny
Llama: each trains, saves what peft loads, resumes exactly, merges and exports through the
export's own check."""

import json

import pytest
import torch

from conftest import logged, stopped_at, tiny_sft
from swiftlm.cli.main import main
from tolerance import assert_same_weights

ADAPTER = "adapter_model.safetensors"
STEPS = dict(max_steps=4, save_steps=2, lora_dropout=0)
# VeRA and IA3 train a vector per layer (on frozen random or no projections): they need a
# larger step to move the loss in 4 steps.
LEARNING_RATES = {"vera": 1e-1, "ia3": 1e-1}
PEFT_TYPES = {
    "vera": "VERA", "loha": "LOHA", "lokr": "LOKR", "oft": "OFT", "boft": "BOFT", "ia3": "IA3",
}  # fmt: skip
PROMPT = [[1, 5, 9, 14, 3, 27, 8, 2]]


def _train(model_dir, data, out, **flags) -> list:
    assert main(tiny_sft(model_dir, data, out, **{**STEPS, **flags})) == 0
    return logged(out)


def _resumes_exactly(model_dir, data, run, tmp_path, weights: str, **flags) -> None:
    """A copy stopped after step 2, resumed, equals the uninterrupted run bit for bit."""
    resumed = stopped_at(run, 2, tmp_path / "resumed")
    again = {**STEPS, **flags, "resume_from_checkpoint": "auto"}
    assert main(tiny_sft(model_dir, data, resumed, **again)) == 0
    assert logged(resumed) == logged(run)
    assert_same_weights(run / "final" / weights, resumed / "final" / weights)


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(PROMPT)).logits


def _base(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


@pytest.mark.parametrize("train_type", list(PEFT_TYPES))
def test_peft_tuner_trains_saves_resumes_merges_and_exports(
    train_type, tiny_model_dir, chat_jsonl, tmp_path, capsys
):
    from peft import PeftModel

    run = tmp_path / "run"
    lr = LEARNING_RATES.get(train_type, 1e-2)
    losses = _train(tiny_model_dir, chat_jsonl, run, train_type=train_type, learning_rate=lr)
    assert losses[-1] < losses[0] - 0.1, losses
    config = json.loads((run / "final" / "adapter_config.json").read_text())
    assert config["peft_type"] == PEFT_TYPES[train_type]
    _resumes_exactly(
        tiny_model_dir, chat_jsonl, run, tmp_path, ADAPTER, train_type=train_type,
        learning_rate=lr,
    )  # fmt: skip
    adapted = PeftModel.from_pretrained(_base(tiny_model_dir), run / "final").eval()
    unmerged = _logits(adapted)
    assert (unmerged - _logits(_base(tiny_model_dir))).abs().max() > 1e-3  # it trained
    # float32: W x + (delta W) x against (W + delta W) x, a few roundings of logits of size ~5.
    torch.testing.assert_close(_logits(adapted.merge_and_unload()), unmerged, atol=1e-5, rtol=0)
    out = tmp_path / "merged"
    argv = ["export", "--ckpt_dir", str(run), "--merge_lora", "true", "--output_dir", str(out)]
    assert main(argv) == 0
    assert "saved folder read back" in capsys.readouterr().out  # the export checked itself
    torch.testing.assert_close(_logits(_base(out)), unmerged, atol=1e-5, rtol=0)


@pytest.mark.parametrize("init_weights", ["pissa", "olora"])
def test_pissa_and_olora_final_is_a_plain_lora_of_the_original_model(
    init_weights, tiny_model_dir, chat_jsonl, tmp_path
):
    """final/ (converted, rank 2r) on the original base = the trained model as it trained
    (the residual base W_res + the last checkpoint's adapter, rebuilt independently)."""
    from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    run = tmp_path / "run"
    losses = _train(tiny_model_dir, chat_jsonl, run, init_weights=init_weights, learning_rate=1e-2)
    assert losses[-1] < losses[0] - 0.1, losses
    config = json.loads((run / "final" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["init_lora_weights"]) == (16, 64, True)
    config = json.loads((run / "checkpoints" / "step-4" / "adapter_config.json").read_text())
    assert config["init_lora_weights"] == init_weights  # checkpoints: the trained form
    trained = get_peft_model(
        _base(tiny_model_dir),
        LoraConfig(r=8, lora_alpha=32, target_modules="all-linear", init_lora_weights=init_weights),
    )
    set_peft_model_state_dict(trained, load_file(run / "checkpoints" / "step-4" / ADAPTER))
    expected = _logits(trained.eval())
    converted = PeftModel.from_pretrained(_base(tiny_model_dir), run / "final").eval()
    torch.testing.assert_close(_logits(converted), expected, atol=1e-5, rtol=0)
    out = tmp_path / "merged"
    argv = ["export", "--ckpt_dir", str(run), "--merge_lora", "true", "--output_dir", str(out)]
    assert main(argv) == 0
    torch.testing.assert_close(_logits(_base(out)), expected, atol=1e-5, rtol=0)
    _resumes_exactly(
        tiny_model_dir, chat_jsonl, run, tmp_path, ADAPTER, init_weights=init_weights,
        learning_rate=1e-2,
    )  # fmt: skip


def test_lisa_trains_only_the_sampled_layers_and_resumes_exactly(
    tiny_model_dir, chat_jsonl, tmp_path, capsys
):
    from safetensors.torch import load_file

    from swiftlm.tuners.lisa import sampled_layers

    lisa = dict(train_type="full", lisa_activated_layers=1, lisa_step_interval=2, seed=3)
    run = tmp_path / "run"
    losses = _train(tiny_model_dir, chat_jsonl, run, learning_rate=1e-3, **lisa)
    assert losses[-1] < losses[0] - 0.1, losses
    assert "LISA: 1 of 2 decoder layers train at a time" in capsys.readouterr().out
    before = load_file(tiny_model_dir / "model.safetensors")
    after = load_file(run / "final" / "model.safetensors")
    trained = {i for window in (0, 1) for i in sampled_layers(2, 1, 3, window)}
    for name, tensor in before.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        changed = not torch.equal(tensor, after[name])
        if layer is None or layer in trained:  # embeddings, head, final norm always train
            assert changed or "norm" in name, name
        else:
            assert not changed, f"{name} of a layer LISA never sampled changed"
    _resumes_exactly(
        tiny_model_dir, chat_jsonl, run, tmp_path, "model.safetensors", learning_rate=1e-3,
        **lisa,
    )  # fmt: skip


@pytest.mark.numerics
def test_loha_under_ddp_matches_one_process(tiny_model_dir, chat_jsonl, tmp_path):
    from tolerance import assert_close, assert_trained_weights_close, forward_terms

    flags = dict(train_type="loha", learning_rate=1e-2, max_steps=4, save_steps=4, lora_dropout=0)
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    assert (
        main(tiny_sft(tiny_model_dir, chat_jsonl, single, per_device_train_batch_size=4, **flags))
        == 0
    )
    argv = tiny_sft(
        tiny_model_dir, chat_jsonl, ddp, per_device_train_batch_size=2, nproc_per_node=2,
        master_port=29571, **flags,
    )  # fmt: skip
    assert main(argv) == 0
    assert_close(logged(ddp), logged(single), terms=forward_terms(tokens=64) + 2, what="loss")
    assert_trained_weights_close(
        single / "final" / ADAPTER, ddp / "final" / ADAPTER, learning_rate=1e-2, steps=4
    )


def test_lora_plus_changes_the_run_and_resumes_exactly(tiny_model_dir, chat_jsonl, tmp_path):
    """--lorap_lr_ratio 16 puts the B matrices in groups of their own at 16x the rate; ratio 1
    is plain LoRA. A resume rebuilds the same groups and continues bit for bit."""
    run = dict(STEPS, lorap_lr_ratio=16, learning_rate="1e-3")
    plus, plain = tmp_path / "plus", tmp_path / "plain"
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, plus, **run)) == 0
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, plain, **{**run, "lorap_lr_ratio": 1})) == 0
    assert logged(plus)[0] == logged(plain)[0]  # B starts at 0: the first loss is the same
    assert logged(plus)[1:] != logged(plain)[1:]
    resumed = stopped_at(plus, 2, tmp_path / "resumed")
    again = dict(run, resume_from_checkpoint="auto")
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, resumed, **again)) == 0
    assert logged(resumed) == logged(plus)
    assert_same_weights(plus / "final" / ADAPTER, resumed / "final" / ADAPTER)
