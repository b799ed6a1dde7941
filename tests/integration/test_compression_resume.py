"""A compressed DDP run (2 gloo ranks) resumed from a checkpoint equals the run never stopped
(1e-6): top-k's residuals and PowerSGD's errors, Q factors, counter and generator are saved
per rank (rank_state/compression-rank{r}, safetensors + JSON) and restored.

Each 2-rank launch costs ~8-12 s on this machine: slow."""

import json

import pytest
from safetensors.torch import load_file

from conftest import logged, stopped_at, tiny_sft
from swiftlm.cli.main import main
from tolerance import assert_same_weights

RUN = dict(
    train_type="lora",
    lora_dropout=0,
    learning_rate="2e-2",
    per_device_train_batch_size=1,
    gradient_accumulation_steps=2,
    max_steps=8,
    save_steps=3,
    nproc_per_node=2,
)
WEIGHTS = {"lora": "final/adapter_model.safetensors", "full": "final/model.safetensors"}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("method", "train_type", "port"),
    [
        ("topk", "lora", 30030),
        ("powersgd", "lora", 30031),
        # Full fine-tuning spreads the weights over buckets that DDP rebuilds after the first
        # step: the resumed run's first step sees other buckets than the saved run's last.
        ("topk", "full", 30032),
        ("powersgd", "full", 30033),
    ],
)
def test_compressed_run_resumes_exactly(
    tiny_model_dir, chat_jsonl, tmp_path, method, train_type, port
):
    full = tmp_path / "full"
    lr = "2e-2" if train_type == "lora" else "1e-3"
    run = dict(RUN, grad_compression=method, master_port=port, train_type=train_type)
    run["learning_rate"] = lr
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, full, **run)) == 0
    # step 6: PowerSGD compresses from its third step, so its Q's and errors are in use
    step = full / "checkpoints" / "step-6"
    for rank in (0, 1):
        meta = json.loads((step / "rank_state" / f"compression-rank{rank}.json").read_text())
        assert meta["tree"]["method"] == method
        tensors = load_file(step / "rank_state" / f"compression-rank{rank}.safetensors")
        assert tensors and all(t.abs().sum() > 0 for t in tensors.values())
    resumed = stopped_at(full, 6, tmp_path / "resumed")
    argv = tiny_sft(tiny_model_dir, chat_jsonl, resumed, **run)
    assert main([*argv, "--resume_from_checkpoint", "auto"]) == 0
    weights = WEIGHTS[train_type]
    assert_same_weights(full / weights, resumed / weights)
    assert logged(resumed) == logged(full)
