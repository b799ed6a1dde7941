"""The CLI contract: every flag, YAML key and logger a user gives is used or rejected by name.

Parser-level cases run without a model; the cases about what a run trains on run the tiny
Llama through `swiftlm.cli.main.main`, as a user would.
"""

import importlib.util
import json

import pytest
import yaml

from conftest import CHAT_ROWS, tiny_sft, write_jsonl
from swiftlm.cli.main import main
from swiftlm.config import UNUSED_FLAGS, TrainConfig, parse_config
from swiftlm.config.parse import flag_owners
from swiftlm.errors import ConfigError


def parse(argv):
    return parse_config(TrainConfig, argv, "swiftlm sft", unused=UNUSED_FLAGS["sft"])


def error_of(capsys, argv) -> str:
    """Run the CLI, expect a usage error (exit 2), return its stderr."""
    assert main(argv) == 2
    return capsys.readouterr().err


# ---- list flags and repetitions --------------------------------------------------------------


@pytest.mark.bad_input(
    input="`--dataset a.jsonl --dataset b.jsonl` (a list flag repeated)",
    outcome="Both datasets are used (as `--dataset a.jsonl b.jsonl`); config.yaml lists both",
)
def test_a_repeated_dataset_flag_trains_on_every_dataset(tiny_model_dir, tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", CHAT_ROWS[:10])
    second = write_jsonl(tmp_path / "b.jsonl", CHAT_ROWS[10:16])
    out = tmp_path / "run"
    argv = tiny_sft(tiny_model_dir, first, out, max_steps=1)
    assert main([*argv, "--dataset", str(second)]) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["data"]["dataset"] == [str(first), str(second)]
    state = json.loads((out / "checkpoints" / "step-1" / "trainer_state.json").read_text())
    assert state["num_train_samples"] == 16


def test_both_spellings_of_several_values_are_the_same():
    spaced = parse(["--dataset", "a.jsonl", "b.csv", "--target_modules", "q_proj", "v_proj"])
    repeated = parse(
        ["--dataset", "a.jsonl", "--target_modules", "q_proj", "--dataset=b.csv"]
        + ["--target_modules", "v_proj"]
    )
    assert spaced.data.dataset == repeated.data.dataset == ["a.jsonl", "b.csv"]
    assert spaced.tuner.target_modules == repeated.tuner.target_modules == ["q_proj", "v_proj"]


@pytest.mark.bad_input(
    input="A scalar flag given twice with different values (`--max_steps 3 --max_steps 5`)",
    outcome="Error naming the flag and both values; the same value twice is accepted",
)
def test_a_scalar_flag_given_twice_must_agree(capsys):
    with pytest.raises(ConfigError) as info:
        parse(["--max_steps", "3", "--lora_rank", "4", "--max_steps=5"])
    assert str(info.value) == (
        "--max_steps is given twice with different values (--max_steps 3, then --max_steps 5); "
        "give it once"
    )
    assert parse(["--max_steps", "3", "--max_steps", "3"]).train.max_steps == 3
    assert "--learning_rate is given twice" in error_of(
        capsys, ["sft", "--learning_rate", "1e-4", "--learning_rate", "1e-3"]
    )


def test_a_flag_overrides_the_yaml_file_without_counting_as_a_repetition(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("max_steps: 3\ndataset: [a.jsonl, b.jsonl]\n")
    cfg = parse([str(config), "--max_steps", "5", "--dataset", "c.jsonl"])
    assert cfg.train.max_steps == 5
    assert cfg.data.dataset == ["c.jsonl"]


@pytest.mark.bad_input(
    input="A YAML key given twice (twice in one mapping, or flat and in its section)",
    outcome="Error naming the file, the line and the key",
)
def test_a_yaml_key_given_twice_is_an_error(tmp_path, capsys):
    repeated = tmp_path / "repeated.yaml"
    repeated.write_text("dataset: [a.jsonl]\nlora_rank: 4\nlora_rank: 8\n")
    err = error_of(capsys, ["sft", str(repeated)])
    assert f"{repeated}:3: key 'lora_rank' is given twice (first on line 2); keep one" in err
    both = tmp_path / "both.yaml"
    both.write_text("lora_rank: 4\ntuner:\n  lora_rank: 8\n")
    err = error_of(capsys, ["sft", str(both)])
    assert "'lora_rank' is given twice (at the top level and in section 'tuner')" in err


# ---- --report_to -----------------------------------------------------------------------------


@pytest.mark.bad_input(
    input="`--report_to foo` (an unknown logger), or `none` beside a logger",
    outcome="Error naming the value and the loggers there are, before anything loads",
)
def test_an_unknown_logger_is_an_error(capsys):
    err = error_of(capsys, ["sft", "--report_to", "wandb", "foo"])
    assert "--report_to wandb foo: the loggers are tensorboard, wandb and swanlab" in err
    err = error_of(capsys, ["sft", "--report_to", "none", "tensorboard"])
    assert "--report_to none tensorboard" in err
    assert parse(["--report_to", "none"]).output.report_to == ["none"]


@pytest.mark.bad_input(
    input="`--report_to wandb` without the wandb package",
    outcome="Error naming the package and `pip install 'swiftlm[wandb]'` before the model loads",
)
def test_a_missing_logger_package_names_the_extra(tiny_model_dir, chat_jsonl, tmp_path, capsys):
    import importlib.util as util

    real_find_spec = util.find_spec

    def without_wandb(name, *args):
        return None if name == "wandb" else real_find_spec(name, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(util, "find_spec", without_wandb)
        argv = tiny_sft(
            tiny_model_dir, chat_jsonl, tmp_path / "run", max_steps=1, report_to="wandb"
        )
        err = error_of(capsys, argv)
    assert "--report_to wandb needs the wandb package: pip install 'swiftlm[wandb]'" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs the wandb extra")
def test_wandb_logs_every_step_offline(tiny_model_dir, chat_jsonl, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    flags = dict(max_steps=2, report_to=["wandb", "tensorboard"])
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, out, **flags)) == 0
    run_id = (out / "wandb_run_id").read_text().strip()
    (history,) = (out / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
    # The offline log holds each history row as protobuf with JSON values: the logged keys.
    data = history.read_bytes()
    for key in (b"loss", b"grad_norm", b"learning_rate", b"tokens_per_second"):
        assert key in data, key
    assert list((out / "tb").glob("events.out.tfevents.*")), "tensorboard ran beside wandb"


# ---- each command's flags --------------------------------------------------------------------


def help_text(command: str, capsys) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return capsys.readouterr().out


@pytest.mark.bad_input(
    input="A flag the subcommand does not use (`swiftlm pt --loss_scope all`, "
    "`swiftlm infer --dataset x`), as a flag or a YAML key",
    outcome="Error: the flag is not used by that subcommand; its `--help` does not list it",
)
@pytest.mark.parametrize("command", ["sft", "pt", "infer", "export", "deploy"])
def test_help_lists_only_the_flags_a_command_uses(command, capsys, tmp_path):
    text = help_text(command, capsys)
    listed = {line.split()[0][2:] for line in text.splitlines() if line.startswith("  --")}
    for flag in UNUSED_FLAGS[command]:
        assert flag not in listed, flag
        assert f"--{flag} is not used by `swiftlm {command}`" in error_of(
            capsys, [command, f"--{flag}", "1"]
        )
    config = tmp_path / "cfg.yaml"
    for flag in sorted(UNUSED_FLAGS[command])[:1]:
        config.write_text(f"{flag}: 1\n")
        assert f"'{flag}' is not used by `swiftlm {command}`" in error_of(
            capsys, [command, str(config)]
        )


def test_unused_flags_tables_name_real_flags():
    from swiftlm.cli.main import COMMANDS
    from swiftlm.config.commands import COMMAND_CONFIGS as configs

    assert set(configs) == set(COMMANDS) == set(UNUSED_FLAGS)  # every command has its table
    for command, unused in UNUSED_FLAGS.items():
        assert unused <= set(flag_owners(configs[command])), command


def test_pt_help_keeps_pretraining_flags_and_drops_chat_ones(capsys):
    listed = help_text("pt", capsys)
    for flag in ("--dataset", "--max_length", "--packing", "--lora_rank", "--deepspeed"):
        assert flag in listed
    for flag in ("--loss_scope", "--system", "--truncation_strategy", "--group_size"):
        assert flag not in listed


@pytest.mark.bad_input(
    input="A mistyped subcommand (`swiftlm sfft`)",
    outcome="Error with the nearest subcommand and the list of subcommands",
)
def test_unknown_command_suggests_the_nearest(capsys):
    assert main(["sfft"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'sfft'; did you mean 'sft'?" in err
    assert "commands:" in err
