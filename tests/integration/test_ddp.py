"""DDP over 2 gloo ranks on CPU equals one process with the same global batch.

Each 2-rank launch costs ~7 s (two torch imports), so one launch covers several checks.
"""

import pytest

from conftest import logged, max_weight_difference, tiny_sft
from swiftlm.cli.main import main

ADAPTER = "adapter_model.safetensors"
STEPS = dict(
    lora_dropout=0, learning_rate="1e-2", max_steps=5, gradient_accumulation_steps=2, save_steps=5
)


def test_ddp_two_ranks_match_a_single_process(tiny_model_dir, chat_jsonl, tmp_path, capfd):
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    assert (
        main(tiny_sft(tiny_model_dir, chat_jsonl, single, per_device_train_batch_size=4, **STEPS))
        == 0
    )
    assert (
        main(
            tiny_sft(
                tiny_model_dir,
                chat_jsonl,
                ddp,
                per_device_train_batch_size=2,
                **STEPS,
                nproc_per_node=2,
                master_port=29517,
            )
        )
        == 0
    )
    assert "x 2 (DDPStrategy" in capfd.readouterr().out
    assert logged(ddp) == pytest.approx(logged(single), abs=1e-5)
    assert max_weight_difference(single / "final" / ADAPTER, ddp / "final" / ADAPTER) < 1e-5
    # One metrics writer (rank 0) and one consolidated checkpoint with a RNG file per rank.
    assert len(logged(ddp)) == 5
    step = ddp / "checkpoints" / "step-5"
    assert (step / "COMPLETE").is_file() and (step / "rng-rank1.safetensors").is_file()
