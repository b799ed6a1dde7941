"""DeepSpeed ZeRO over 2 gloo ranks on CPU equals one process with the same global batch
(fp32, tolerance 1e-5). DeepSpeed builds a small shared-memory op on first use (~30 s, cached
in TORCH_EXTENSIONS_DIR)."""

import pytest

from conftest import logged, tiny_sft
from swiftlm.cli.main import main
from tolerance import (
    assert_close,
    assert_same_weights,
    assert_trained_weights_close,
    forward_terms,
)

pytest.importorskip(
    "deepspeed", reason="DeepSpeed is an optional extra: pip install swiftlm[deepspeed]"
)

SLOW = pytest.mark.slow
STEPS = dict(lora_dropout=0, max_steps=5, gradient_accumulation_steps=2, save_steps=5)
# chat rows are under 64 tokens; + 2: the all-reduce of two ranks' sums
TERMS = forward_terms(tokens=64) + 2


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("stage", "train_type", "lr", "weights", "port"),
    [
        ("zero2", "lora", "1e-2", "adapter_model.safetensors", 29631),
        ("zero3", "full", "1e-3", "model.safetensors", 29632),
        # The same ZeRO stages as above with the other tuner / CPU offload: on in -m slow.
        pytest.param("zero3", "lora", "1e-2", "adapter_model.safetensors", 29633, marks=SLOW),
        pytest.param("zero2_offload", "full", "1e-3", "model.safetensors", 29634, marks=SLOW),
    ],
)
def test_zero_matches_single_process(
    tiny_model_dir, chat_jsonl, tmp_path, capfd, stage, train_type, lr, weights, port
):
    single, zero = tmp_path / "single", tmp_path / stage
    run = dict(train_type=train_type, learning_rate=lr, **STEPS)
    assert (
        main(tiny_sft(tiny_model_dir, chat_jsonl, single, per_device_train_batch_size=4, **run))
        == 0
    )
    assert (
        main(
            tiny_sft(
                tiny_model_dir,
                chat_jsonl,
                zero,
                per_device_train_batch_size=2,
                **run,
                nproc_per_node=2,
                deepspeed=stage,
                master_port=port,
            )
        )
        == 0
    )
    assert f"x 2 (DeepSpeed {stage} over 2 ranks" in capfd.readouterr().out
    assert_close(logged(zero), logged(single), terms=TERMS, what="loss")
    trained = dict(learning_rate=float(lr), steps=STEPS["max_steps"])
    assert_trained_weights_close(single / "final" / weights, zero / "final" / weights, **trained)
    step = zero / "checkpoints" / "step-5"
    assert (step / "COMPLETE").is_file() and (step / "deepspeed").is_dir()
    # the checkpoint also holds a consolidated model/adapter, loadable as is
    assert_trained_weights_close(single / "final" / weights, step / weights, **trained)


@pytest.mark.numerics
@pytest.mark.bad_input(
    input="`--deepspeed zero2` in one process (no `--nproc_per_node`)",
    outcome="Trains like one process without DeepSpeed and resumes: a one-rank process group "
    "is set up first (before, a DeepSpeed traceback: No module named 'mpi4py')",
)
def test_zero2_in_one_process_matches_plain_training_and_resumes(
    tiny_model_dir, chat_jsonl, tmp_path
):
    import os
    import shutil

    import torch.distributed as dist

    single, zero, resumed = tmp_path / "single", tmp_path / "zero2", tmp_path / "resumed"
    run = dict(train_type="lora", learning_rate="1e-2", per_device_train_batch_size=4)
    run |= {**STEPS, "save_steps": 2}
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, single, **run)) == 0
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, zero, **run, deepspeed="zero2")) == 0
    assert_close(logged(zero), logged(single), terms=TERMS, what="loss")
    adapter = "final/adapter_model.safetensors"
    trained = dict(learning_rate=1e-2, steps=STEPS["max_steps"])
    assert_trained_weights_close(single / adapter, zero / adapter, **trained)
    # The one-rank group is gone and LOCAL_RANK unset again: the next run in this process
    # (here, the resume) must not look like a torchrun worker.
    assert not dist.is_initialized() and "LOCAL_RANK" not in os.environ

    # Resume from step 2, as if the run had stopped after saving it.
    shutil.copytree(zero, resumed)
    shutil.rmtree(resumed / "final")
    for later in ("step-4", "step-5"):
        shutil.rmtree(resumed / "checkpoints" / later, ignore_errors=True)
    again = tiny_sft(tiny_model_dir, chat_jsonl, resumed, **run, deepspeed="zero2")
    assert main([*again, "--resume_from_checkpoint", "auto"]) == 0
    assert_same_weights(zero / adapter, resumed / adapter)  # the same arithmetic, resumed
