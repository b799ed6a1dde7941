"""DDP over 2 gloo ranks on CPU equals one process with the same global batch.

Each 2-rank launch costs ~7 s (two torch imports), so one launch covers several checks.
"""

import pytest

from conftest import logged, tiny_sft
from swiftlm.cli.main import main
from tolerance import assert_close, assert_trained_weights_close, forward_terms

ADAPTER = "adapter_model.safetensors"
STEPS = dict(
    lora_dropout=0, learning_rate="1e-2", max_steps=5, gradient_accumulation_steps=2, save_steps=5
)


@pytest.mark.numerics
def test_ddp_two_ranks_match_a_single_process(tiny_model_dir, chat_jsonl, tmp_path):
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
    # chat rows are under 64 tokens; + 2: the all-reduce of two ranks' sums
    assert_close(logged(ddp), logged(single), terms=forward_terms(tokens=64) + 2, what="loss")
    assert all(n > 0 for n in logged(ddp, "comm_bytes_per_rank"))  # DDP's all-reduce ran
    a, b = single / "final" / ADAPTER, ddp / "final" / ADAPTER
    assert_trained_weights_close(a, b, learning_rate=1e-2, steps=STEPS["max_steps"])
    # One metrics writer (rank 0) and one consolidated checkpoint with a RNG file per rank.
    assert len(logged(ddp)) == 5
    step = ddp / "checkpoints" / "step-5"
    assert (step / "COMPLETE").is_file() and (step / "rng-rank1.safetensors").is_file()


def test_every_strategy_implements_the_whole_protocol():
    """The loop calls these without probing: each strategy class must define them all."""
    import torch

    from swiftlm.distributed.config import DistArguments
    from swiftlm.distributed.env import DistContext
    from swiftlm.distributed.pp import PipelineParallelStrategy
    from swiftlm.distributed.spmd import SPMDStrategy
    from swiftlm.distributed.strategy import Strategy, build_strategy
    from swiftlm.distributed.zero import DeepSpeedStrategy

    methods = [n for n, v in vars(Strategy).items() if callable(v) and not n.startswith("_")]
    assert {"wrap", "pipeline_step", "step_metrics", "clip_and_step", "save_final"} <= set(methods)
    for cls in (SPMDStrategy, PipelineParallelStrategy, DeepSpeedStrategy):
        assert all(callable(getattr(cls, name, None)) for name in methods), cls
    cpu = torch.device("cpu")
    pipeline = build_strategy(DistArguments(pipeline_parallel_size=2), DistContext(2, 4), cpu)
    ddp = build_strategy(DistArguments(), DistContext(1, 2), cpu)
    assert isinstance(pipeline, PipelineParallelStrategy) and isinstance(ddp, SPMDStrategy)
    assert (pipeline.pipeline_parallel, pipeline.dp_rank, pipeline.dp_size) == (True, 0, 2)
    assert (ddp.pipeline_parallel, ddp.dp_rank, ddp.dp_size) == (False, 1, 2)
    assert str(pipeline) == "pipeline parallel 2 x DDP 2" and str(ddp) == "DDP 2"
