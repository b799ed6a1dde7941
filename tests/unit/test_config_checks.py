"""Single-field checks: each section rejects its own bad values when it is built, from flags,
a YAML file or a saved config.yaml, with a message that names the flag, the value and what
it accepts."""

import dataclasses

import pytest
import yaml

from swiftlm.cli.main import main
from swiftlm.config import (
    ExportConfig,
    InferConfig,
    TrainConfig,
    load_saved_config,
    parse_config,
    save_config,
)
from swiftlm.config.checks import above, at_least, check_fields, within
from swiftlm.data.config import DataArguments
from swiftlm.distributed.config import DistArguments
from swiftlm.engine.config import GenerationArguments
from swiftlm.errors import ConfigError
from swiftlm.export.config import ExportArguments
from swiftlm.infer.config import InferArguments
from swiftlm.models.config import QuantArguments
from swiftlm.train.config import OutputArguments, TrainArguments
from swiftlm.tuners.config import TunerArguments

SECTIONS = [
    DataArguments,
    DistArguments,
    ExportArguments,
    GenerationArguments,
    InferArguments,
    OutputArguments,
    QuantArguments,
    TrainArguments,
    TunerArguments,
]


@pytest.mark.parametrize(
    ("section", "values", "message"),
    [
        (DataArguments, {"max_length": 1}, "--max_length 1 must be at least 2"),
        (
            DataArguments,
            {"split_dataset_ratio": 1.0},
            "--split_dataset_ratio 1.0 must be in [0, 1)",
        ),
        (DataArguments, {"split_dataset_ratio": float("nan")}, "--split_dataset_ratio nan"),
        (TunerArguments, {"lora_rank": 0}, "--lora_rank 0 must be at least 1"),
        (TunerArguments, {"lora_dropout": 1.0}, "--lora_dropout 1.0 must be in [0, 1)"),
        (TrainArguments, {"per_device_train_batch_size": -1}, "must be at least 1, or auto"),
        (TrainArguments, {"gradient_accumulation_steps": 0}, "--gradient_accumulation_steps 0"),
        (TrainArguments, {"learning_rate": 0.0}, "--learning_rate 0.0 must be above 0"),
        (TrainArguments, {"learning_rate": -1e-4}, "or unset: the default of the train type"),
        (TrainArguments, {"warmup_ratio": 1.5}, "--warmup_ratio 1.5 must be in [0, 1]"),
        (TrainArguments, {"adam_beta2": 1.0}, "--adam_beta2 1.0 must be in [0, 1)"),
        (TrainArguments, {"max_tokens_per_batch": -5}, "--max_tokens_per_batch -5 must be at"),
        (OutputArguments, {"logging_steps": 0}, "--logging_steps 0 must be at least 1"),
        (OutputArguments, {"save_steps": 0}, "--save_steps 0 must be at least 1"),
        (OutputArguments, {"eval_steps": 0}, "--eval_steps 0 must be at least 1"),
        (GenerationArguments, {"max_new_tokens": 0}, "--max_new_tokens 0 must be at least 1"),
        (GenerationArguments, {"top_k": -1}, "--top_k -1 must be 0 (off) or more"),
        (GenerationArguments, {"repetition_penalty": 0}, "--repetition_penalty 0 must be above"),
        (InferArguments, {"max_batch_size": 0}, "--max_batch_size 0 must be at least 1"),
        (DistArguments, {"nproc_per_node": 0}, "--nproc_per_node 0 must be at least 1"),
        (DistArguments, {"tensor_parallel_size": 0}, "--tensor_parallel_size 0 must be at least"),
        (DistArguments, {"pipeline_parallel_size": 0}, "--pipeline_parallel_size 0 must be at"),
        (DistArguments, {"fsdp": "fsdp1"}, "--fsdp fsdp1: use fsdp2"),
        (DistArguments, {"topk_ratio": 0.0}, "--topk_ratio 0.0: must be in (0, 1]"),
        (DistArguments, {"dist_timeout": 0}, "--dist_timeout 0 must be above 0"),
        (QuantArguments, {"group_size": 0}, "--group_size 0: pass a positive size"),
        (QuantArguments, {"quant_n_samples": 0}, "--quant_n_samples must be at least 1, not 0"),
        (ExportArguments, {"max_shard_size": "5 gigs"}, "--max_shard_size 5 gigs: give a whole"),
    ],
)
def test_a_section_rejects_a_bad_value_naming_the_flag(section, values, message):
    with pytest.raises(ConfigError) as info:
        section(**values)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("section", "values"),
    [
        (TrainArguments, {"per_device_train_batch_size": 0}),  # auto
        (TrainArguments, {"learning_rate": None, "max_grad_norm": 0.0, "warmup_ratio": 1.0}),
        (OutputArguments, {"eval_steps": None}),
        (GenerationArguments, {"temperature": 0.0, "top_p": 1.0, "top_k": 0}),
        (DistArguments, {"fsdp": "full_shard", "heartbeat_timeout": 0.0, "topk_ratio": 1.0}),
        (QuantArguments, {"group_size": -1}),  # GPTQ: one scale per output channel
        (ExportArguments, {"max_shard_size": "500MB"}),
        (ExportArguments, {"max_shard_size": "2gib"}),
    ],
)
def test_edge_values_and_unset_values_are_accepted(section, values):
    assert dataclasses.asdict(section(**values)).items() >= values.items()


def test_every_section_builds_with_its_defaults():
    for section in SECTIONS:
        section()


def test_every_bad_value_of_a_section_in_one_message():
    with pytest.raises(ConfigError) as info:
        GenerationArguments(temperature=-1, top_p=0)
    assert str(info.value) == (
        "--temperature -1 must be 0 (greedy) or more; --top_p 0 must be in (0, 1]"
    )


def test_replace_checks_the_new_value():
    train = TrainArguments()
    with pytest.raises(ConfigError, match="--gradient_accumulation_steps 0"):
        dataclasses.replace(train, gradient_accumulation_steps=0)


def test_check_helpers_name_interval_ends_and_skip_unset_values():
    assert within(0, 1, open_low=True).failure("top_p", 0) == "--top_p 0 must be in (0, 1]"
    assert at_least(2, note="tokens").failure("n", 1) == "--n 1 must be at least 2 (tokens)"
    assert above(0).failure("lr", None) is None
    assert above(0).failure("lr", float("nan")) == "--lr nan must be above 0"

    @dataclasses.dataclass
    class Section:
        a: int = 0

    with pytest.raises(AttributeError):  # a check of a field the section does not have
        check_fields(Section(), b=at_least(1))


# ---- through the parser and the CLI -----------------------------------------------------------


def test_flags_and_yaml_values_are_checked_when_parsed(tmp_path):
    with pytest.raises(ConfigError, match="--lora_rank 0 must be at least 1"):
        parse_config(TrainConfig, ["--lora_rank", "0"], "swiftlm sft")
    path = tmp_path / "cfg.yaml"
    path.write_text("train:\n  warmup_ratio: 2\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"--warmup_ratio 2.0 must be in \[0, 1\]"):
        parse_config(TrainConfig, [str(path)], "swiftlm sft")
    with pytest.raises(ConfigError, match=r"--top_p 1.5 must be in \(0, 1\]"):
        parse_config(InferConfig, ["--top_p", "1.5"], "swiftlm infer")
    with pytest.raises(ConfigError, match="--quant_n_samples must be at least 1, not 0"):
        parse_config(ExportConfig, ["--quant_n_samples", "0"], "swiftlm export")


def test_auto_batch_size_still_parses():
    cfg = parse_config(TrainConfig, ["--per_device_train_batch_size", "auto"], "swiftlm sft")
    assert cfg.train.per_device_train_batch_size == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["sft", "--max_length", "1"], "swiftlm sft: error: --max_length 1 must be at least 2"),
        (["infer", "--temperature", "-0.5"], "swiftlm infer: error: --temperature -0.5 must be"),
        (["export", "--max_shard_size", "big"], "swiftlm export: error: --max_shard_size big"),
        (["sft", "--nproc_per_node", "0"], "swiftlm sft: error: --nproc_per_node 0 must be"),
    ],
)
def test_cli_reports_a_bad_value_as_a_config_error(argv, message, capsys):
    assert main(argv) == 2  # before anything loads or launches
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_a_saved_run_with_a_bad_value_names_it(tmp_path):
    path = tmp_path / "config.yaml"
    save_config(TrainConfig(), path)
    saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    saved["train"]["gradient_accumulation_steps"] = 0
    path.write_text(yaml.safe_dump(saved), encoding="utf-8")
    with pytest.raises(ConfigError, match="--gradient_accumulation_steps 0 must be at least 1"):
        load_saved_config(TrainConfig, path)
