"""The run directory settled before anything loads (`train/rundir.py`), the flag rules around it
(`config/rules_run_dir.py`) and the comparison of a resumed run with its saved config.yaml
(`train/resume_match.py`). Nothing here loads a model."""

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from swiftlm.config import TrainConfig, parse_config, save_config
from swiftlm.config.rules import failures
from swiftlm.errors import ConfigError
from swiftlm.train import rundir
from swiftlm.train.resolve import resolve_defaults
from swiftlm.train.resume_match import differences
from swiftlm.train.rundir import next_version_dir, settle_run_dir

CPU = torch.device("cpu")
SFT_LIKE = SimpleNamespace(name="sft", supports_packing=True, default_datasets=("swiftlm/x",))


def train(*flags, dataset=("d.jsonl",)) -> TrainConfig:
    argv = ["--dataset", *dataset, *map(str, flags)]
    return parse_config(TrainConfig, argv, "swiftlm sft")


@pytest.fixture(autouse=True)
def first_attempt(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)


# ---- versions -------------------------------------------------------------------------------


def test_versions_count_up_from_the_highest_like_ms_swift(tmp_path):
    assert next_version_dir(tmp_path / "new", "20250101-120000") == (
        tmp_path / "new" / "v0-20250101-120000"
    )
    for name in ("v0-20240101-000000", "v3-x", "v12", "vfoo", "other"):
        (tmp_path / name).mkdir()
    assert next_version_dir(tmp_path, "T").name == "v13-T"
    assert re.fullmatch(r"v13-\d{8}-\d{6}", next_version_dir(tmp_path).name)


def test_add_version_creates_its_folder_at_once(tmp_path):
    settled = settle_run_dir(train("--output_dir", tmp_path / "runs", "--add_version"), print)
    folder = tmp_path / "runs" / next(p.name for p in (tmp_path / "runs").iterdir())
    assert settled.output.output_dir == str(folder) and folder.is_dir()
    assert settled.output.add_version is False  # the saved config.yaml names the folder itself


@pytest.fixture
def torchrun(monkeypatch):
    """A torchrun worker of one launch; `restart()` makes it a restarted one."""
    monkeypatch.setattr(rundir, "launched_by_torchrun", lambda: True)
    monkeypatch.setattr(rundir, "_this_launch", lambda: "node0:4242")
    return SimpleNamespace(restart=lambda: monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1"))


def test_a_restart_continues_the_run_its_first_attempt_started(tmp_path, torchrun):
    flags = ["--output_dir", tmp_path / "a", "--overwrite_output_dir"]
    assert settle_run_dir(train(*flags), print).output.resume_from_checkpoint is None
    assert (tmp_path / "a" / ".launch").read_text() == "node0:4242\n"
    (tmp_path / "a" / "config.yaml").write_text("")  # its run began, then a worker died
    torchrun.restart()
    settled = settle_run_dir(train(*flags), print)  # never cleared by a restart
    assert settled.output.output_dir == str(tmp_path / "a") and (tmp_path / "a").is_dir()
    assert settled.output.resume_from_checkpoint == "auto"


def test_a_restart_with_add_version_continues_its_version(tmp_path, torchrun, monkeypatch):
    (tmp_path / "v0-20240101-000000").mkdir()  # an earlier run
    flags = ["--output_dir", tmp_path, "--add_version"]
    first = settle_run_dir(train(*flags), print).output.output_dir
    assert Path(first).name.startswith("v1-")
    torchrun.restart()
    settled = settle_run_dir(train(*flags), print)
    assert (settled.output.output_dir, settled.output.resume_from_checkpoint) == (first, "auto")
    assert sorted(p.name[:3] for p in tmp_path.iterdir()) == ["v0-", "v1-"]


def test_a_restart_after_a_refused_first_attempt_is_refused_too(tmp_path, torchrun):
    used = tmp_path / "used"
    used.mkdir()
    (used / "config.yaml").write_text("")  # an earlier run, of another launch
    torchrun.restart()
    with pytest.raises(ConfigError, match="holds an earlier run"):
        settle_run_dir(train("--output_dir", used), print)
    (used / ".launch").write_text("node0:1\n")  # started by another launch
    with pytest.raises(ConfigError, match="holds an earlier run"):
        settle_run_dir(train("--output_dir", used), print)
    # --add_version: an earlier launch's version is not this launch's run.
    versioned = settle_run_dir(train("--output_dir", used, "--add_version"), print)
    assert Path(versioned.output.output_dir).name.startswith("v0-")


def test_an_empty_or_missing_output_dir_starts_a_new_run(tmp_path):
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "empty", tmp_path / "missing"):
        assert settle_run_dir(train("--output_dir", out), print).output.output_dir == str(out)


# ---- flag rules ------------------------------------------------------------------------------


@pytest.mark.bad_input(
    input="--overwrite_output_dir or --add_version with --resume_from_checkpoint, or both together",
    outcome="Refused before anything loads: the message names the contradiction and the fix",
)
@pytest.mark.parametrize(
    ("flags", "rule", "message"),
    [
        (
            ["--overwrite_output_dir", "--resume_from_checkpoint", "auto"],
            "overwrite_or_resume",
            "--overwrite_output_dir true deletes the run that --resume_from_checkpoint auto "
            "continues; drop one of them",
        ),
        (
            ["--add_version", "--resume_from_checkpoint", "auto"],
            "add_version_not_auto",
            "--add_version true writes into a fresh subfolder, where --resume_from_checkpoint "
            "auto finds no checkpoint; to continue a versioned run, pass its folder: "
            "--output_dir runs/a/v<N>-<timestamp> --resume_from_checkpoint auto",
        ),
        (
            ["--overwrite_output_dir", "--add_version"],
            "overwrite_or_add_version",
            "--overwrite_output_dir true and --add_version true both given: one deletes the "
            "earlier run in --output_dir runs/a, the other keeps it beside a fresh subfolder; "
            "drop one of them",
        ),
    ],
)
def test_run_dir_flags_that_contradict_each_other(flags, rule, message):
    broken = failures(train("--output_dir", "runs/a", *flags))
    assert broken == [(rule, message)]


def test_add_version_with_an_explicit_checkpoint_is_a_fork():
    flags = ["--output_dir", "runs/a", "--add_version", "--resume_from_checkpoint", "ck"]
    assert failures(train(*flags)) == []


# ---- resuming ----------------------------------------------------------------------------------


def saved(tmp_path, *flags) -> dict:
    """The flat flag values of a config.yaml saved by a run with `flags`."""
    save_config(resolve_defaults(train(*flags), SFT_LIKE, CPU), tmp_path / "config.yaml")
    sections = yaml.safe_load((tmp_path / "config.yaml").read_text())
    return {key: value for section in sections.values() for key, value in section.items()}


def now(*flags, dataset=("d.jsonl",)) -> TrainConfig:
    return resolve_defaults(train(*flags, dataset=dataset), SFT_LIKE, CPU)


def test_a_resume_with_the_saved_flags_differs_in_nothing(tmp_path):
    flags = ["--lora_rank", 4, "--max_length", 512, "--per_device_train_batch_size", 4]
    assert differences(saved(tmp_path, *flags), now(*flags)) == []
    # Flags that leave the checkpoint's meaning alone may change.
    changed = [*flags, "--save_steps", 7, "--lora_dropout", 0.2, "--max_grad_norm", 0.5]
    assert differences(saved(tmp_path, *flags), now(*changed)) == []


def test_each_difference_that_matters_is_named_in_flag_order(tmp_path):
    before = saved(tmp_path, "--target_modules", "q_proj", "v_proj")
    after = now("--train_type", "dora", "--packing", "--warmup_ratio", 0.1, dataset=["d", "e"])
    assert differences(before, after) == [
        "--dataset: saved d.jsonl, now d e",
        "--train_type: saved lora, now dora",
        "--target_modules: saved q_proj v_proj, now all-linear",
        "--warmup_ratio: saved 0.0, now 0.1",
        "--packing: saved false, now true",
    ]


def test_unset_values_compare_as_they_resolve(tmp_path):
    # Unset --learning_rate resolves to the train type's default; auto batch size takes the
    # saved one later (resolve_auto_batch), so it matches any saved size.
    before = saved(tmp_path, "--per_device_train_batch_size", 6)
    assert differences(before, now("--per_device_train_batch_size", "auto")) == []
    same = now("--per_device_train_batch_size", 6, "--learning_rate", 1e-4)
    assert differences(before, same) == []


def test_lora_flags_do_not_matter_to_a_full_run(tmp_path):
    before = saved(tmp_path, "--train_type", "full", "--lora_rank", 4)
    assert differences(before, now("--train_type", "full", "--lora_rank", 16)) == []


def test_padding_free_matters_with_a_token_budget_only(tmp_path):
    before = saved(tmp_path, "--padding_free", "true")
    assert differences(before, now("--padding_free", "false")) == []
    budget = ["--max_tokens_per_batch", 4096]
    before = saved(tmp_path, *budget, "--padding_free", "true")
    assert differences(before, now(*budget, "--padding_free", "false")) == [
        "--padding_free: saved true, now false"
    ]


def test_a_config_yaml_without_a_flag_skips_it(tmp_path):
    before = saved(tmp_path)
    del before["loss_scope"]
    assert differences(before, now("--loss_scope", "all")) == []


def test_the_batch_size_counts_across_data_parallel_ranks(tmp_path):
    # Saved by 2 ranks x 2 samples: one process may resume with 4 (the same samples per step),
    # or with 2 and twice the accumulation; otherwise the global batch would change.
    before = saved(tmp_path, "--per_device_train_batch_size", 2)
    assert differences(before, now("--per_device_train_batch_size", 4), ranks=(2, 1)) == []
    assert differences(before, now("--per_device_train_batch_size", 2), ranks=(2, 1)) == [
        "global batch: saved 4 rows per step, now 2 rows per step (2 per device x 1 "
        "data-parallel rank x 1 accumulation); --gradient_accumulation_steps 2 keeps it"
    ]
    budget = ["--max_tokens_per_batch", 4096]
    before = saved(tmp_path, *budget)
    assert differences(before, now(*budget), ranks=(2, 1)) == [
        "global batch: saved 2 budget micro-batches per step, now 1 budget micro-batches per "
        "step (1 data-parallel rank x 1 accumulation); --gradient_accumulation_steps 2 keeps it"
    ]
