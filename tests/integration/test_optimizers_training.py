"""Every `--optim` trains the tiny Llama (full fine-tuning, one process): the loss goes down,
and a run resumed from its step-2 checkpoint continues bit for bit as the uninterrupted run
(losses and final weights), so each optimizer's state round-trips through the checkpoint."""

import json

import pytest

from conftest import logged, stopped_at, tiny_sft
from swiftlm.cli.main import main
from tolerance import assert_same_weights

WEIGHTS = "model.safetensors"
RUN = dict(train_type="full", max_steps=4, save_steps=2, per_device_train_batch_size=4, seed=3)
# Per optimizer: a learning rate at which 4 steps lower the loss of the tiny model, and the
# settings that make its state matter across the resume at step 2.
OPTIMIZERS = {
    "adamw_torch": dict(learning_rate=3e-3),
    "adamw_torch_fused": dict(learning_rate=3e-3),
    # bitsandbytes quantizes moments of tensors of 4096+ elements (the tiny model's
    # embeddings and MLP matrices); smaller ones keep 32-bit moments.
    "adamw_8bit": dict(learning_rate=3e-3),
    "paged_adamw_8bit": dict(learning_rate=3e-3),
    "adafactor": dict(learning_rate=3e-3),
    "muon": dict(learning_rate=3e-3),
    "schedule_free_adamw": dict(learning_rate=3e-3, warmup_ratio=0.5),
    # rank 8 < the layers' widths; the projection made at step 1 serves steps 2 and 3 (3 after
    # the resume: the saved matrix) and is made anew at step 4 (APOLLO: the saved seed).
    "galore_adamw": dict(learning_rate=3e-3, optim_args="rank=8,update_proj_gap=3"),
    "apollo_adamw": dict(learning_rate=3e-3, optim_args="rank=8,update_proj_gap=3"),
}


@pytest.mark.parametrize("optim", list(OPTIMIZERS))
def test_optimizer_trains_and_resumes_exactly(optim, tiny_model_dir, chat_jsonl, tmp_path):
    flags = dict(RUN, optim=optim, **OPTIMIZERS[optim])
    if optim == "schedule_free_adamw":  # evaluation swaps to its averaged weights and back
        flags.update(val_dataset=chat_jsonl, eval_steps=1)
    run = tmp_path / "run"
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, run, **flags)) == 0
    losses = logged(run)
    assert len(losses) == 4 and losses[-1] < losses[0], losses

    resumed = stopped_at(run, 2, tmp_path / "resumed")
    again = tiny_sft(tiny_model_dir, chat_jsonl, resumed, **flags, resume_from_checkpoint="auto")
    assert main(again) == 0
    assert logged(resumed) == losses
    evaluated = logged(run, "eval_loss")
    assert len(evaluated) == (4 if "val_dataset" in flags else 0)
    assert logged(resumed, "eval_loss") == evaluated
    assert_same_weights(run / "final" / WEIGHTS, resumed / "final" / WEIGHTS)


def test_schedule_free_checkpoints_hold_the_averaged_weights(tiny_model_dir, chat_jsonl, tmp_path):
    """A schedule-free run saves its averaged weights x (with the optimizer in eval mode), and
    final/ holds the x of the last step, which the last checkpoint holds too."""
    run = tmp_path / "run"
    flags = dict(RUN, optim="schedule_free_adamw", learning_rate=3e-3)
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, run, **flags)) == 0
    meta = json.loads((run / "checkpoints" / "step-4" / "optimizer.json").read_text())
    assert all(group["train_mode"] is False for group in meta["param_groups"])
    assert_same_weights(run / "checkpoints" / "step-4" / WEIGHTS, run / "final" / WEIGHTS)


def test_muon_with_lora_trains_and_resumes(tiny_model_dir, chat_jsonl, tmp_path):
    """Muon updates the LoRA matrices (2-D hidden weights); the adapter resumes exactly."""
    flags = dict(RUN, train_type="lora", optim="muon", learning_rate=1e-2, lora_dropout=0)
    run = tmp_path / "run"
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, run, **flags)) == 0
    losses = logged(run)
    assert losses[-1] < losses[0], losses
    resumed = stopped_at(run, 2, tmp_path / "resumed")
    again = tiny_sft(tiny_model_dir, chat_jsonl, resumed, **flags, resume_from_checkpoint="auto")
    assert main(again) == 0
    assert logged(resumed) == losses
    adapter = "adapter_model.safetensors"
    assert_same_weights(run / "final" / adapter, resumed / "final" / adapter)
