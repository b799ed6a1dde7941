"""Rules between flags (`config/rules.py`) and the one resolution step of a training config
(`train/resolve.py`). Nothing here loads a model."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from swiftlm.config import ExportConfig, InferConfig, TrainConfig, parse_config
from swiftlm.config.rules import RULES, Facts, check, failures
from swiftlm.errors import ConfigError
from swiftlm.train import resolve
from swiftlm.train.resolve import resolve_config, run_facts

SFT_LIKE = SimpleNamespace(name="sft", supports_packing=True, default_datasets=("swiftlm/x",))
PAIRWISE = SimpleNamespace(name="dpo", supports_packing=False, default_datasets=())


def train(*flags, dataset=True) -> TrainConfig:
    argv = (["--dataset", "d.jsonl"] if dataset else []) + [str(f) for f in flags]
    return parse_config(TrainConfig, argv, "swiftlm sft")


def broken(cfg, facts=None) -> list[str]:
    return [name for name, _ in failures(cfg, facts)]


def test_rule_names_are_unique_per_command():
    for rules in RULES.values():
        names = [rule.name for rule in rules]
        assert len(names) == len(set(names))


def test_default_configs_break_no_rule():
    assert broken(train()) == []
    assert broken(InferConfig()) == []
    check(TrainConfig(), Facts(method=SFT_LIKE))  # the built-in default job


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max_steps", 0, "--num_train_epochs", 0], "set --num_train_epochs > 0 or"),
        (["--max_tokens_per_batch", 100, "--max_length", 512], "--max_tokens_per_batch 100 is"),
        (["--resume_from_checkpoint", "auto"], "auto needs the --output_dir of the run"),
        (["--node_rank", 2, "--nnodes", 2], "--node_rank 2 must be below --nnodes 2"),
        (["--pipeline_parallel_size", 2, "--packing"], "its stages need fixed shapes"),
        (["--strategy", "pp", "--padding_free", "true"], "its stages need fixed shapes"),
        (["--pipeline_parallel_size", 2, "--per_device_train_batch_size", "auto"], "give a"),
        (["--pipeline_parallel_size", 2, "--split_dataset_ratio", 0.1], "evaluation is not"),
        (["--pipeline_parallel_size", 2, "--torch_dtype", "float16"], "use bfloat16 or float32"),
        (["--deepspeed", "zero2", "--tensor_parallel_size", 2], "--deepspeed owns the model"),
        (["--deepspeed", "zero2", "--fsdp", "fsdp2"], "--deepspeed conflicts with --fsdp"),
        (["--deepspeed", "zero2", "--strategy", "ddp"], "pick one engine"),
        (["--strategy", "deepspeed"], "--strategy deepspeed needs --deepspeed zero1"),
        (["--fsdp", "fsdp2", "--strategy", "ddp"], "--fsdp conflicts with --strategy ddp"),
        (["--pipeline_parallel_size", 2, "--tensor_parallel_size", 2], "is not supported yet"),
        (["--strategy", "ddp", "--tensor_parallel_size", 2], "drop --strategy ddp"),
        (["--tensor_parallel_size", 2, "--train_type", "dora"], "use lora, or fsdp2 for DoRA"),
        (["--fsdp", "fsdp2", "--grad_compression", "fp16"], "FSDP2 does not use it"),
        (["--deepspeed", "zero1", "--grad_compression", "bf16"], "DeepSpeed does not use it"),
        (["--deepspeed", "zero1", "--nonfinite_loss", "skip"], "--nonfinite_loss skip is not"),
        (["--strategy", "single", "--nproc_per_node", 2], "--strategy single cannot run"),
        (["--tensor_parallel_size", 2, "--nproc_per_node", 3], "must divide the number of"),
    ],
)
def test_a_broken_training_rule_names_the_flags_and_the_fix(flags, message):
    with pytest.raises(ConfigError, match=message):
        check(train(*flags))


@pytest.mark.parametrize(
    "flags",
    [
        # Pipeline and tensor parallel each combine with data parallel (DDP or FSDP2).
        ["--pipeline_parallel_size", 2, "--fsdp", "fsdp2", "--nproc_per_node", 4],
        ["--pipeline_parallel_size", 2, "--nproc_per_node", 4],
        ["--tensor_parallel_size", 2, "--fsdp", "fsdp2", "--nproc_per_node", 4],
        ["--deepspeed", "zero3", "--nproc_per_node", 2],
        ["--grad_compression", "powersgd", "--nproc_per_node", 2],
        ["--grad_compression", "topk", "--strategy", "ddp"],
        ["--max_tokens_per_batch", 4096, "--padding_free", "true", "--packing"],
    ],
)
def test_combinations_that_train(flags):
    assert broken(train(*flags)) == []


def test_world_size_comes_from_the_facts_or_the_flags():
    single = train("--strategy", "single")
    assert broken(single) == []
    assert broken(single, Facts(world_size=2)) == ["single_is_one_process"]
    tp3 = train("--tensor_parallel_size", 2)
    assert broken(tp3, Facts(world_size=3)) == ["split_size_divides_world"]
    assert broken(tp3, Facts(world_size=4)) == []


def test_method_rules_need_the_method():
    no_data = train(dataset=False)
    assert broken(no_data) == []  # no method: its rules are skipped
    assert broken(no_data, Facts(method=SFT_LIKE)) == []  # the built-in default data
    with pytest.raises(ConfigError, match="--dataset is required"):
        check(train("--model", "m", dataset=False), Facts(method=SFT_LIKE))
    with pytest.raises(ConfigError, match="--dataset is required"):
        check(no_data, Facts(method=PAIRWISE))
    packed = train("--packing")
    with pytest.raises(ConfigError, match="not available with dpo: its samples cannot share"):
        check(packed, Facts(method=PAIRWISE))


def test_all_broken_rules_are_listed_in_table_order():
    cfg = train("--max_steps", 0, "--num_train_epochs", 0, "--strategy", "deepspeed")
    names = broken(cfg)
    assert names == ["steps_or_epochs", "strategy_deepspeed_needs_config"]
    with pytest.raises(ConfigError, match="set --num_train_epochs"):  # the first one
        check(cfg)


# ---- infer and export -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dataset", "a.jsonl"], "use --val_dataset a.jsonl"),
        (["--result_path", "out.jsonl"], "--result_path is for batch mode"),
        (["--ckpt_dir", "run", "--adapters", "a"], "--ckpt_dir and --adapters both given"),
    ],
)
def test_infer_rules(flags, message):
    with pytest.raises(ConfigError, match=message):
        check(parse_config(InferConfig, flags, "swiftlm infer"))


def export(*flags) -> ExportConfig:
    argv = ["--output_dir", "out", *map(str, flags)]
    return parse_config(ExportConfig, argv, "swiftlm export")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--to_gguf", "--to_onnx"], "--to_gguf and --to_onnx both given"),
        ([], "nothing to export"),
        (["--quant_method", "int8", "--quant_bits", 4], "use --quant_method int4"),
        (["--quant_method", "int4", "--quant_bits", 8], "use --quant_method int8"),
        (["--quant_method", "int4", "--quant_bits", 3], "drop --quant_bits$"),
        (["--quant_method", "bnb", "--quant_bits", 2], "pass --quant_bits 4 or 8"),
        (["--quant_method", "int4", "--group_size", 100], "--group_size 32, 64 or 128"),
        (["--quant_method", "bnb", "--group_size", 64], "applies to --quant_method int4"),
        (["--quant_method", "int8", "--bnb_4bit_quant_type", "fp4"], "bnb --quant_bits 4 only"),
        (
            ["--quant_method", "bnb", "--quant_bits", 8, "--bnb_4bit_use_double_quant", "false"],
            "not to --quant_method bnb --quant_bits 8",
        ),
        (["--quant_method", "gptq", "--quant_bits", 3], "takes --quant_bits 4 or 8, not 3"),
        (["--quant_method", "awq", "--quant_bits", 8], "takes --quant_bits 4, not 8"),
        (["--quant_method", "awq", "--group_size", 16], "awq takes --group_size 32, 64 or 128"),
        (["--quant_method", "gptq", "--max_length", 8], "need at least 10 tokens"),
        (["--to_onnx", "--torch_dtype", "bfloat16"], "--to_onnx writes and checks float32"),
    ],
)
def test_export_rules(flags, message):
    with pytest.raises(ConfigError, match=message):
        check(export(*flags))


def test_export_output_dir_is_required():
    cfg = parse_config(ExportConfig, ["--merge_lora"], "swiftlm export")
    assert broken(cfg) == ["export_output_dir_given"]
    assert broken(export("--merge_lora")) == []
    assert broken(export("--quant_method", "gptq", "--group_size", -1)) == []


# ---- resolution -------------------------------------------------------------------------------

CPU = torch.device("cpu")


def test_resolve_fills_every_default_known_before_the_model_loads(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    cfg = train(dataset=False)
    resolved = resolve_config(cfg, SFT_LIKE, "tiny", CPU)
    assert resolved.data.dataset == ["swiftlm/x"]
    assert resolved.train.learning_rate == 1e-4
    assert resolved.output.output_dir.startswith("output/tiny-")
    assert resolved.train.padding_free is True  # free on CPUs
    assert resolved.output.resume_from_checkpoint is None
    assert cfg == train(dataset=False)  # the parsed config is left as it was
    full = resolve_config(train("--train_type", "full"), SFT_LIKE, "tiny", CPU)
    assert full.train.learning_rate == 1e-5


def test_resolve_keeps_what_the_user_gave(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    flags = ["--learning_rate", "3e-4", "--output_dir", "runs/a", "--padding_free", "false"]
    cfg = train(*flags, "--per_device_train_batch_size", "auto")
    resolved = resolve_config(cfg, SFT_LIKE, "tiny", CPU)
    assert resolved.data.dataset == ["d.jsonl"]
    assert resolved.train.learning_rate == 3e-4
    assert resolved.output.output_dir == "runs/a"
    assert resolved.train.padding_free is False
    assert resolved.train.per_device_train_batch_size == 0  # auto: resolved after loading


@pytest.mark.parametrize(
    ("flags", "method"),
    [(["--packing"], SFT_LIKE), (["--pipeline_parallel_size", 2], SFT_LIKE), ([], PAIRWISE)],
)
def test_padding_free_stays_off_where_rows_need_fixed_shapes(flags, method, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert resolve_config(train(*flags), method, "tiny", CPU).train.padding_free is False


def test_padding_free_on_cuda_follows_flash_attention(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(resolve, "flash_attention_available", lambda device: False)
    assert resolve_config(train(), SFT_LIKE, "tiny", cuda).train.padding_free is False
    monkeypatch.setattr(resolve, "flash_attention_available", lambda device: True)
    assert resolve_config(train(), SFT_LIKE, "tiny", cuda).train.padding_free is True


def test_run_facts_read_the_torchrun_world(monkeypatch):
    for name in ("LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert run_facts(SFT_LIKE) == Facts(world_size=1, method=SFT_LIKE)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert run_facts(SFT_LIKE).world_size == 4


def test_resolved_config_round_trips_through_config_yaml(tmp_path, monkeypatch):
    from swiftlm.config import load_saved_config, save_config

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    resolved = resolve_config(train(), SFT_LIKE, "tiny", CPU)
    resolved = dataclasses.replace(
        resolved, train=dataclasses.replace(resolved.train, per_device_train_batch_size=6)
    )
    save_config(resolved, tmp_path / "config.yaml")
    assert load_saved_config(TrainConfig, tmp_path / "config.yaml") == resolved
    assert resolve._previous_batch_size(tmp_path) == 6
