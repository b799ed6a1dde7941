"""FSDP2 (fully_shard) over 2 gloo ranks on CPU equals one process with the same global batch,
and its sharded checkpoints resume across world sizes (2 ranks -> 1 process and back).

Each 2-rank launch costs ~7-10 s (two torch imports), so one launch serves several checks:
three launches in all. Single-process runs go through `main` in this process.
"""

import json
from concurrent.futures import Future

import pytest
import torch
from safetensors.torch import load_file

from conftest import logged, stopped_at
from swiftlm.checkpoint import COMPLETE, mark_complete_when_written
from swiftlm.checkpoint.sharded import PendingSave
from swiftlm.cli.main import main
from swiftlm.distributed.config import DistArguments
from swiftlm.distributed.mesh import ParallelDims
from swiftlm.distributed.strategy import plan_parallelism
from swiftlm.errors import CheckpointError, ConfigError
from tolerance import assert_close, assert_trained_weights_close, forward_terms

# chat rows are under 64 tokens; + 2: the all-reduce of two ranks' sums
TERMS = forward_terms(tokens=64) + 2
COMMON = [
    "--torch_dtype",
    "float32",
    "--report_to",
    "none",
    "--logging_steps",
    "1",
    "--lora_dropout",
    "0",
    "--max_steps",
    "8",
    "--gradient_accumulation_steps",
    "2",
    "--save_steps",
    "4",
]
ADAPTER, FULL = "adapter_model.safetensors", "model.safetensors"


def single(base, out, *extra):
    assert (
        main([*base, "--output_dir", str(out), "--per_device_train_batch_size", "4", *extra]) == 0
    )


def fsdp2(base, out, port, *extra):
    args = ["--per_device_train_batch_size", "2", "--nproc_per_node", "2", "--master_port", port]
    args += ["--dist_timeout", "120"]  # a rank stuck in a collective fails the test quickly
    assert main([*base, "--output_dir", str(out), *args, *extra]) == 0


def assert_same_run(run, reference, weights, learning_rate: float):
    assert len(logged(run)) == 8
    assert_close(logged(run), logged(reference), terms=TERMS, what="loss")
    eval_losses = logged(reference, "eval_loss")
    assert_close(logged(run, "eval_loss"), eval_losses, terms=TERMS, what="eval_loss")
    a, b = run / "final" / weights, reference / "final" / weights
    assert_trained_weights_close(a, b, learning_rate=learning_rate, steps=8)


@pytest.mark.numerics
def test_lora_matches_one_process_and_resumes_across_world_sizes(
    tiny_model_dir, chat_jsonl, tmp_path, capfd
):
    base = ["sft", "--model", str(tiny_model_dir), "--dataset", str(chat_jsonl), *COMMON]
    base += ["--learning_rate", "1e-2"]
    reference, sharded = tmp_path / "single", tmp_path / "fsdp2"
    single(base, reference)
    fsdp2(base, sharded, "29531", "--strategy", "fsdp2", "--async_save")
    assert_same_run(sharded, reference, ADAPTER, 1e-2)
    step = sharded / "checkpoints" / "step-4"
    assert (step / COMPLETE).is_file() and (step / "rng-rank1.safetensors").is_file()
    assert (step / "dcp" / ".metadata").is_file()  # the background save finished

    # The checkpoint folder is a plain peft adapter as well.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), step)
    expected = load_file(reference / "checkpoints" / "step-4" / ADAPTER)
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(expected) > 0
    loaded = {key: loaded[key.replace(".weight", ".default.weight")] for key in expected}
    assert_trained_weights_close(loaded, expected, learning_rate=1e-2, steps=4)

    # Saved by 2 ranks, resumed by one process: DCP reshards; steps 5-8 as uninterrupted.
    resumed = stopped_at(sharded, 4, tmp_path / "resumed-by-one")
    single(base, resumed, "--resume_from_checkpoint", "auto")
    assert "resumed from" in capfd.readouterr().out
    assert_same_run(resumed, reference, ADAPTER, 1e-2)

    # Saved by one process (full tensors), resumed sharded over 2 ranks.
    resumed = stopped_at(reference, 4, tmp_path / "resumed-by-two")
    fsdp2(base, resumed, "29532", "--fsdp", "fsdp2", "--resume_from_checkpoint", "auto")
    assert "at step 4" in capfd.readouterr().out
    assert_same_run(resumed, reference, ADAPTER, 1e-2)


@pytest.mark.numerics
def test_full_fine_tuning_matches_one_process_and_resumes_on_one(
    tiny_model_dir, chat_jsonl, tmp_path
):
    base = ["sft", "--model", str(tiny_model_dir), "--dataset", str(chat_jsonl), *COMMON]
    base += ["--train_type", "full", "--learning_rate", "1e-3"]
    # 3 validation samples: one rank evaluates 2, the other 1 and a masked one to keep in step.
    base += ["--split_dataset_ratio", "0.125"]
    reference, sharded = tmp_path / "single", tmp_path / "fsdp2"
    single(base, reference)
    fsdp2(base, sharded, "29533", "--strategy", "fsdp2")
    assert_same_run(sharded, reference, FULL, 1e-3)
    assert len(logged(sharded, "eval_loss")) == 2

    from transformers import AutoModelForCausalLM

    step = sharded / "checkpoints" / "step-4"
    model = AutoModelForCausalLM.from_pretrained(step)
    assert json.loads((step / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    expected = load_file(reference / "checkpoints" / "step-4" / FULL)
    state = {key: model.state_dict()[key] for key in expected}
    assert_trained_weights_close(state, expected, learning_rate=1e-3, steps=4)

    resumed = stopped_at(sharded, 4, tmp_path / "resumed-by-one")
    single(base, resumed, "--resume_from_checkpoint", "auto")
    assert_same_run(resumed, reference, FULL, 1e-3)


def test_complete_is_written_only_once_a_background_save_succeeded(tmp_path):
    done, failed = tmp_path / "done", tmp_path / "failed"
    done.mkdir(), failed.mkdir()
    writing, crashing = Future(), Future()
    mark_complete_when_written(done, 4, writing)
    mark_complete_when_written(failed, 4, crashing)
    assert not (done / COMPLETE).exists()
    writing.set_result(None)
    crashing.set_exception(OSError("disk full"))
    assert (done / COMPLETE).read_text() == "step 4\n"
    assert not (failed / COMPLETE).exists()

    # The strategy waits for its background save before the next one and at the end.
    pending = PendingSave()
    pending.track(crashing, failed)
    with pytest.raises(CheckpointError, match="failed .it stays incomplete.: disk full"):
        pending.wait()
    pending.wait()  # nothing left to wait for


def test_one_process_asked_for_fsdp_runs_unsharded():
    assert plan_parallelism(DistArguments(fsdp="fsdp2"), world_size=1) == ParallelDims()
    assert plan_parallelism(DistArguments(fsdp="fsdp2"), world_size=2) == ParallelDims(
        dp=2, data_parallel="fsdp2"
    )


def tiny_config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


def test_blocks_are_found_under_peft_and_missing_ones_are_named():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from swiftlm.distributed.fsdp2 import find_block_lists

    config = tiny_config(layers=2)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules="all-linear"))
    assert find_block_lists(model) == [model.base_model.model.model.layers]
    with pytest.raises(ConfigError, match="no list of transformer blocks"):
        find_block_lists(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoint_of_another_adapter_is_refused(tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from swiftlm.checkpoint.sharded import load_sharded_state, save_sharded_state

    config = tiny_config(layers=1)

    def adapter(rank):
        model = get_peft_model(
            LlamaForCausalLM(config), LoraConfig(r=rank, target_modules="all-linear")
        )
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])

    saved, optimizer = adapter(4)
    save_sharded_state(tmp_path, saved, optimizer)  # one process, no process group
    with pytest.raises(CheckpointError, match="does not match this model"):
        load_sharded_state(tmp_path, *adapter(2))


class _RemoveFile:
    """A pickle that deletes a file when it is loaded."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        import os

        return (os.remove, (self.path,))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_sharded_checkpoint_that_would_unpickle_is_refused(tmp_path):
    import pickle

    import torch.distributed.checkpoint as dcp

    from swiftlm.checkpoint.sharded import check_tensors_only

    dcp.save({"weight": torch.ones(2), "note": {"lr": 0.1}}, checkpoint_id=tmp_path / "objects")
    with pytest.raises(CheckpointError, match="not only tensors"):
        check_tensors_only(tmp_path / "objects")

    canary, forged = tmp_path / "canary", tmp_path / "forged"
    canary.touch(), forged.mkdir()
    (forged / ".metadata").write_bytes(pickle.dumps(_RemoveFile(canary)))
    with pytest.raises(CheckpointError, match="which is not DCP metadata"):
        check_tensors_only(forged)
    assert canary.exists()
