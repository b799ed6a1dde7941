"""Config parsing: flags and YAML land in typed sections; bad input fails with a clear error."""

import dataclasses

import pytest
import yaml

from swiftlm.config import (
    UNUSED_FLAGS,
    InferConfig,
    RLHFConfig,
    TrainConfig,
    load_saved_config,
    parse_config,
    save_config,
)
from swiftlm.config.parse import build_parser, flag_owners, section_types
from swiftlm.errors import ConfigError

PROG = "swiftlm sft"

TRAIN_FLAGS = [
    "model",
    "dataset",
    "val_dataset",
    "split_dataset_ratio",
    "train_type",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "max_length",
    "truncation_strategy",
    "num_train_epochs",
    "max_steps",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_ratio",
    "weight_decay",
    "max_grad_norm",
    "torch_dtype",
    "gradient_checkpointing",
    "seed",
    "output_dir",
    "logging_steps",
    "save_steps",
    "save_total_limit",
    "eval_steps",
    "resume_from_checkpoint",
    "system",
]

INFER_FLAGS = [
    "model",
    "adapters",
    "ckpt_dir",
    "val_dataset",
    "result_path",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "seed",
]


def parse(argv, config_cls=TrainConfig):
    return parse_config(config_cls, argv, PROG)


def write_yaml(tmp_path, data, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if isinstance(data, dict) else data, encoding="utf-8")
    return path


# ---- flags ----------------------------------------------------------------------------------


def test_defaults_without_arguments():
    config = parse([])
    assert config == TrainConfig()
    assert config.tuner.train_type == "lora"
    assert config.tuner.target_modules == ["all-linear"]
    assert config.train.learning_rate is None
    assert config.train.max_steps == -1


def test_flags_land_in_their_sections_with_their_types():
    config = parse(
        [
            "--model", "/models/tiny",
            "--learning_rate", "2e-5",
            "--max_steps", "7",
            "--num_train_epochs", "2",
            "--dataset", "a.jsonl", "b.jsonl#10",
            "--lora_rank", "4",
            "--lora_dropout", "0",
            "--target_modules", "q_proj", "v_proj",
            "--save_total_limit", "3",
            "--output_dir", "runs/x",
            "--gradient_checkpointing",
        ]
    )  # fmt: skip
    assert config.model.model == "/models/tiny"
    assert type(config.train.learning_rate) is float and config.train.learning_rate == 2e-5
    assert type(config.train.max_steps) is int and config.train.max_steps == 7
    assert type(config.train.num_train_epochs) is float and config.train.num_train_epochs == 2.0
    assert config.data.dataset == ["a.jsonl", "b.jsonl#10"]
    assert config.tuner.lora_rank == 4 and type(config.tuner.lora_rank) is int
    assert config.tuner.lora_dropout == 0.0 and type(config.tuner.lora_dropout) is float
    assert config.tuner.target_modules == ["q_proj", "v_proj"]
    assert config.output.save_total_limit == 3
    assert config.output.output_dir == "runs/x"
    assert config.train.gradient_checkpointing is True
    # Untouched knobs keep their defaults.
    assert config.data.val_dataset == []
    assert config.tuner.lora_alpha == 32


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], False),
        (["--gradient_checkpointing"], True),
        (["--gradient_checkpointing", "true"], True),
        (["--gradient_checkpointing", "false"], False),
        (["--gradient_checkpointing=False"], False),
        (["--gradient-checkpointing", "yes"], True),
    ],
)
def test_bool_flag_with_and_without_value(argv, expected):
    assert parse(argv).train.gradient_checkpointing is expected


@pytest.mark.parametrize(
    "argv",
    [
        ["--tuner_type", "full"],
        ["--tuner-type", "full"],
        ["--tuner-type=full"],
        ["--sft_type", "full"],
        ["--train-type", "full"],
    ],
)
def test_ms_swift_aliases_and_dashes(argv):
    assert parse(argv).tuner.train_type == "full"


def test_dashed_flag_names_are_accepted():
    config = parse(["--per-device-train-batch-size", "4", "--learning-rate=3e-4"])
    assert config.train.per_device_train_batch_size == 4
    assert config.train.learning_rate == 3e-4


def test_bad_choice_exits_through_argparse(capsys):
    with pytest.raises(SystemExit) as info:
        parse(["--train_type", "lor"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'lor'" in err
    assert "--train_type" in err


def test_bad_int_exits_through_argparse(capsys):
    with pytest.raises(SystemExit) as info:
        parse(["--max_steps", "ten"])
    assert info.value.code == 2
    assert "invalid int value: 'ten'" in capsys.readouterr().err


def test_unknown_flag_suggests_nearest_name():
    with pytest.raises(ConfigError) as info:
        parse(["--learnin_rate", "1e-4"])
    message = str(info.value)
    assert "unknown flag --learnin_rate" in message
    assert "did you mean 'learning_rate'" in message
    assert "swiftlm sft --help" in message


def test_unknown_flag_with_equals_and_no_near_name():
    with pytest.raises(ConfigError) as info:
        parse(["--max_steps", "2", "--zzzqqq=1"])
    message = str(info.value)
    assert "unknown flag --zzzqqq" in message
    assert "did you mean" not in message


@pytest.mark.parametrize("argv", [["stray"], ["--max_steps", "3", "stray"]])
def test_stray_positional_is_a_config_error(argv):
    with pytest.raises(ConfigError) as info:
        parse(argv)
    message = str(info.value)
    assert "unexpected argument 'stray'" in message
    assert "--flag" in message


def test_yaml_file_must_come_first(tmp_path):
    path = write_yaml(tmp_path, {"max_steps": 3})
    with pytest.raises(ConfigError, match="must end in .yaml and come first"):
        parse(["--lora_rank", "4", str(path)])


# ---- YAML -----------------------------------------------------------------------------------


def test_flat_yaml_file(tmp_path):
    path = write_yaml(
        tmp_path,
        "model: /models/tiny\n"
        "learning_rate: 1e-4\n"
        "max_steps: 12\n"
        "dataset: [a.jsonl, b.jsonl]\n"
        "gradient_checkpointing: true\n"
        "tuner_type: full\n",
    )
    config = parse([str(path)])
    assert config.model.model == "/models/tiny"
    # YAML 1.1 reads `1e-4` (no dot) as the string "1e-4"; it must still become a float.
    assert yaml.safe_load("x: 1e-4")["x"] == "1e-4"
    assert type(config.train.learning_rate) is float
    assert config.train.learning_rate == 0.0001
    assert config.train.max_steps == 12
    assert config.data.dataset == ["a.jsonl", "b.jsonl"]
    assert config.train.gradient_checkpointing is True
    assert config.tuner.train_type == "full"


def test_nested_yaml_sections_and_flags_override(tmp_path):
    path = write_yaml(
        tmp_path,
        "model:\n"
        "  model: /models/tiny\n"
        "  torch_dtype: float32\n"
        "train:\n"
        "  learning_rate: 1e-4\n"
        "  max_steps: 5\n"
        "  gradient_checkpointing: true\n"
        "tuner:\n"
        "  lora_rank: 4\n"
        "  target_modules: [q_proj]\n"
        "dataset: a.jsonl\n"
        "save_steps: 10\n",
        name="cfg.yml",
    )
    config = parse(
        [str(path), "--max_steps", "9", "--gradient_checkpointing", "false", "--lora-rank", "2"]
    )
    assert config.model.model == "/models/tiny"
    assert config.model.torch_dtype == "float32"
    assert config.train.learning_rate == 0.0001
    assert config.train.max_steps == 9
    assert config.train.gradient_checkpointing is False
    assert config.tuner.lora_rank == 2
    assert config.tuner.target_modules == ["q_proj"]
    assert config.data.dataset == ["a.jsonl"]
    assert config.output.save_steps == 10


def test_yaml_list_is_replaced_not_extended_by_flag(tmp_path):
    path = write_yaml(tmp_path, {"dataset": ["a.jsonl", "b.jsonl"]})
    assert parse([str(path), "--dataset", "c.jsonl"]).data.dataset == ["c.jsonl"]


def test_empty_yaml_list_overrides_a_non_empty_default(tmp_path):
    path = write_yaml(tmp_path, "report_to: []\nmax_steps: 3\n")
    config = parse([str(path)])
    assert config.train.max_steps == 3
    assert config.output.report_to == []


def test_unknown_yaml_key_names_file_and_nearest_key(tmp_path):
    path = write_yaml(tmp_path, {"learnin_rate": 1e-4, "max_steps": 3})
    with pytest.raises(ConfigError) as info:
        parse([str(path)])
    message = str(info.value)
    assert str(path) in message
    assert "unknown key 'learnin_rate'" in message
    assert "did you mean 'learning_rate'" in message


def test_unknown_nested_yaml_key_names_section(tmp_path):
    path = write_yaml(tmp_path, {"train": {"lerning_rate": 1e-4}})
    with pytest.raises(ConfigError) as info:
        parse([str(path)])
    message = str(info.value)
    assert str(path) in message
    assert "unknown key 'train.lerning_rate'" in message
    assert "did you mean 'learning_rate'" in message


def test_missing_yaml_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        parse([str(tmp_path / "nope.yaml")])


@pytest.mark.parametrize(
    ("text", "fragment"),
    [("max_steps: [1\n", "not valid YAML"), ("- a\n- b\n", "expected a mapping")],
)
def test_malformed_yaml(tmp_path, text, fragment):
    path = write_yaml(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        parse([str(path)])
    assert str(path) in str(info.value)
    assert fragment in str(info.value)


def test_empty_yaml_file_gives_defaults(tmp_path):
    assert parse([str(write_yaml(tmp_path, ""))]) == TrainConfig()


# ---- saved config ---------------------------------------------------------------------------


def _custom_train_config():
    return parse(
        [
            "--model", "/models/tiny",
            "--dataset", "a.jsonl", "b.jsonl",
            "--system", "You are: helpful",
            "--learning_rate", "1e-5",
            "--num_train_epochs", "0.5",
            "--train_type", "full",
            "--target_modules", "q_proj", "v_proj",
            "--save_total_limit", "2",
            "--gradient_checkpointing",
            "--report_to", "none",
        ]
    )  # fmt: skip


def test_save_then_load_round_trips(tmp_path):
    config = _custom_train_config()
    path = tmp_path / "run" / "config.yaml"
    save_config(config, path)
    saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert list(saved) == list(section_types(TrainConfig))
    assert saved["train"]["learning_rate"] == 1e-5
    loaded = load_saved_config(TrainConfig, path)
    assert loaded == config
    assert type(loaded.train.learning_rate) is float
    assert type(loaded.train.num_train_epochs) is float


def test_saved_config_reruns_through_parse_config(tmp_path):
    config = _custom_train_config()
    path = tmp_path / "config.yaml"
    save_config(config, path)
    assert parse([str(path)]) == config
    assert parse([str(path), "--max_steps", "4"]) == dataclasses.replace(
        config, train=dataclasses.replace(config.train, max_steps=4)
    )


def test_infer_config_round_trips(tmp_path):
    config = parse_config(
        InferConfig,
        ["--model", "m", "--adapters", "a1", "a2", "--temperature", "0.7", "--top_k", "5"],
        "swiftlm infer",
    )
    assert config.infer.adapters == ["a1", "a2"]
    assert config.generation.temperature == 0.7
    assert config.generation.top_k == 5
    path = tmp_path / "infer.yaml"
    save_config(config, path)
    assert load_saved_config(InferConfig, path) == config


def test_load_saved_config_rejects_unknown_key(tmp_path):
    path = write_yaml(tmp_path, {"train": {"max_steps": 3}, "output": {"save_step": 5}})
    with pytest.raises(ConfigError, match="did you mean 'save_steps'"):
        load_saved_config(TrainConfig, path)


# ---- flag names and help --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config_cls", "promised"), [(TrainConfig, TRAIN_FLAGS), (InferConfig, INFER_FLAGS)]
)
def test_flag_names_unique_and_ms_swift_names_present(config_cls, promised):
    names = [
        f.name
        for section in section_types(config_cls).values()
        for f in dataclasses.fields(section)
    ]
    assert len(names) == len(set(names)), "a flag name is defined in two sections"
    owners = flag_owners(config_cls)
    assert sorted(owners) == sorted(names)
    missing = [name for name in promised if name not in owners]
    assert missing == []
    parser = build_parser(config_cls, "swiftlm", "")
    assert [n for n in promised if f"--{n}" not in parser._option_string_actions] == []


def test_flag_owners_map_to_sections():
    owners = flag_owners(TrainConfig)
    assert owners["model"] == "model"
    assert owners["dataset"] == "data"
    assert owners["lora_rank"] == "tuner"
    assert owners["learning_rate"] == "train"
    assert owners["output_dir"] == "output"
    assert flag_owners(InferConfig)["seed"] == "infer"


def test_help_lists_flags_with_their_docs(capsys):
    with pytest.raises(SystemExit) as info:
        parse(["--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "usage: swiftlm sft [config.yaml]" in out
    assert "--lora_rank LORA_RANK" in out
    assert "LoRA rank r. (default: 8)" in out
    assert "Recompute activations in the backward pass to save memory." in out


def test_key_in_the_wrong_section_names_its_section(tmp_path):
    path = write_yaml(tmp_path, {"train": {"lora_rank": 4}})
    with pytest.raises(ConfigError, match="'lora_rank' belongs to section 'tuner', not 'train'"):
        parse([str(path)])


def test_a_run_config_reads_back_as_the_command_that_wrote_it(tmp_path):
    """sft's plugin `--loss_type` and rlhf's method `--loss_type` live in different sections:
    a saved sft run must read back as TrainConfig, an rlhf run as RLHFConfig (infer, deploy,
    eval and export read runs this way)."""
    from swiftlm.config.parse import load_run_config

    sft = parse_config(TrainConfig, ["--model", "m", "--dataset", "d.jsonl"], "sft")
    save_config(sft, tmp_path / "sft.yaml", UNUSED_FLAGS["sft"])
    assert type(load_run_config(tmp_path / "sft.yaml")) is TrainConfig
    rlhf = parse_config(
        RLHFConfig, ["--model", "m", "--dataset", "d.jsonl", "--loss_type", "ipo"], "rlhf"
    )
    save_config(rlhf, tmp_path / "rlhf.yaml", UNUSED_FLAGS["rlhf"])
    loaded = load_run_config(tmp_path / "rlhf.yaml")
    assert type(loaded) is RLHFConfig and loaded.rlhf.loss_type == "ipo"
