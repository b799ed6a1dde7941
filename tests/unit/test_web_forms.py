"""`swiftlm web`'s forms: generated from the flags' documentation, turned back into the command
line of only the changed flags, checked by the command's own parser and rules."""

import dataclasses

import pytest

from swiftlm.config import TrainConfig, parse_config
from swiftlm.errors import ConfigError, DataError
from swiftlm.train.config import TrainArguments
from swiftlm.tuners.config import TunerArguments
from swiftlm.web.forms import build_argv, command_line, form_schema, parse_checked


def fields_of(schema: dict) -> dict:
    return {
        f["name"]: f
        for tab in schema["tabs"]
        for section in tab["sections"]
        for f in section["fields"]
    }


def help_of(section: type, name: str) -> str:
    return next(f.metadata["help"] for f in dataclasses.fields(section) if f.name == name)


def test_the_form_shows_each_flags_help_choices_and_default():
    schema = form_schema("sft")
    assert [tab["name"] for tab in schema["tabs"]] == [
        "Model",
        "Data",
        "Method",
        "Tuner",
        "Training",
        "Distributed",
    ]
    fields = fields_of(schema)
    assert fields["learning_rate"]["help"] == help_of(TrainArguments, "learning_rate")
    assert fields["learning_rate"]["kind"] == "float"
    train_type = fields["train_type"]
    assert train_type["help"] == help_of(TunerArguments, "train_type")
    assert {"full", "lora"} <= set(train_type["choices"])
    assert train_type["default"] == TunerArguments().train_type
    # A flag sft does not use (pre-training's --streaming) and the UI's own are left out.
    assert "streaming" not in fields and "output_dir" not in fields
    # rlhf's method tab holds its method flags; sft's has none.
    rlhf = {tab["name"]: tab for tab in form_schema("rlhf")["tabs"]}
    rlhf_fields = fields_of({"tabs": [rlhf["Method"]]})
    assert "dpo" in rlhf_fields["rlhf_type"]["choices"]


def test_only_changed_flags_go_on_the_command_line_and_it_round_trips():
    values = {
        "max_grad_norm": "1",  # the default 1.0, typed differently: not a change
        "lora_rank": "16",
        "dataset": "a.jsonl b.jsonl",
        "train_type": "lora",  # the default
        "model": "",  # an emptied optional: its default
    }
    argv = build_argv("sft", values)
    assert argv == ["--dataset", "a.jsonl", "b.jsonl", "--lora_rank", "16"]
    assert command_line(["sft", *argv]) == "swiftlm sft --dataset a.jsonl b.jsonl --lora_rank 16"
    cfg = parse_config(TrainConfig, argv, "swiftlm sft")
    assert cfg.tuner.lora_rank == 16
    assert cfg.data.dataset == ["a.jsonl", "b.jsonl"]
    assert cfg.train.max_grad_norm == TrainArguments().max_grad_norm


def test_no_model_nor_dataset_is_checked_as_the_built_in_default_job(tmp_path):
    cfg = parse_checked("sft", ["--output_dir", str(tmp_path / "run")])
    assert cfg.data.dataset == ["swiftlm/self-cognition", "swiftlm/general-qa"]
    assert cfg.tuner.train_type == "lora"


@pytest.mark.bad_input(
    input="`swiftlm web`: a form value of the wrong type (learning_rate `abc`)",
    outcome="The command's own argparse message, shown in the page before anything starts",
)
def test_a_bad_value_is_the_parsers_own_message():
    with pytest.raises(ConfigError, match="--learning_rate.*invalid float value: 'abc'"):
        parse_checked("sft", build_argv("sft", {"learning_rate": "abc"}))
    with pytest.raises(ConfigError, match="unknown flag --no_such_flag"):
        build_argv("sft", {"no_such_flag": "1"})


@pytest.mark.bad_input(
    input="`swiftlm web`: a dataset file that does not exist",
    outcome="`dataset file not found: PATH` in the page, before the run starts",
)
def test_a_missing_dataset_is_refused_before_the_run(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=f"dataset file not found: {missing}"):
        parse_checked("sft", ["--dataset", str(missing)])
