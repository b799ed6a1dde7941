"""Plugins end to end: the example package (examples/plugin_package), installed with pip into a
temporary folder, adds a dataset format, a loss, a reward and a callback that `swiftlm sft` and
`swiftlm rlhf --rlhf_type grpo` use (found through its entry point); the same plugin given as an
`--external_plugins` file does the same; broken plugins are errors that name them (exit 2)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import logged, write_jsonl
from plugin_isolation import isolated_plugins  # noqa: F401 (a fixture)
from swiftlm.cli.main import main
from tolerance import assert_close, forward_terms

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "examples" / "plugin_package"
PLUGIN_FILE = PACKAGE / "swiftlm_demo_plugin" / "__init__.py"
QA_ROWS = [{"q": f"Question {i}?", "a": f"Answer {i} is {i * 7}."} for i in range(8)]
PROMPTS = [{"prompt": f"What is {i} plus {i + 1}?", "solution": str(2 * i + 1)} for i in range(8)]
TINY = {"torch_dtype": "float32", "report_to": "none", "logging_steps": 1}


def command(name: str, model_dir, data, out, **flags) -> list[str]:
    argv = [name, "--model", str(model_dir), "--dataset", str(data), "--output_dir", str(out)]
    for flag, value in {**TINY, **flags}.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        argv += [f"--{flag}", *map(str, values)]
    return argv


def sft_flags(**extra) -> dict:
    # One step holds all 8 rows: the first logged loss is the loss of the untrained model.
    return dict(
        loss_type="demo_focal", max_steps=2, save_steps=1, per_device_train_batch_size=8, **extra
    )


GRPO_FLAGS = dict(
    rlhf_type="grpo", reward_funcs="demo_brevity", max_steps=1, per_device_train_batch_size=8,
    num_generations=4, max_completion_length=8, max_length=64,
)  # fmt: skip


@pytest.fixture(scope="module")
def installed_plugin(tmp_path_factory) -> Path:
    """The example package installed (offline, no build isolation) into a folder of its own:
    on PYTHONPATH, its entry point is what swiftlm finds."""
    root = tmp_path_factory.mktemp("plugin-install")
    shutil.copytree(PACKAGE, root / "src")  # the build writes next to the sources
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    pip += ["--no-index", "--target", str(root / "site"), str(root / "src")]
    subprocess.run(pip, check=True, capture_output=True, timeout=120)
    return root / "site"


def run_swiftlm(argv: list[str], site: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site), "SWIFTLM_DEMO_EVENTS": str(tmp_path / "ev")}
    cmd = [sys.executable, "-m", "swiftlm", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def focal_and_cross_entropy(model_dir: Path, rows: list[dict]) -> tuple[float, float, int]:
    """The mean focal loss (gamma 2) and cross-entropy per label token of the untrained model on
    `rows`, computed here: transformers' model, swiftlm's encoding of the chat rows; and their
    tokens (no row of a batch holds more)."""
    from transformers import AutoModelForCausalLM

    from swiftlm.data.encode import encode_chat_samples
    from swiftlm.models.loader import load_tokenizer

    tokenizer = load_tokenizer(str(model_dir))
    samples = [
        {
            "messages": [
                {"role": "user", "content": r["q"]},
                {"role": "assistant", "content": r["a"]},
            ]
        }
        for r in rows
    ]
    encoded, _ = encode_chat_samples(tokenizer, samples, 2048, "delete", "assistant")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    focal = cross_entropy = 0.0
    tokens = 0
    with torch.no_grad():
        for sample in encoded:
            ids = torch.tensor([sample["input_ids"]])
            targets = torch.tensor(sample["labels"][1:])
            log_probs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            keep = targets != -100
            picked = log_probs[keep].gather(-1, targets[keep].unsqueeze(-1)).squeeze(-1)
            focal += float((-((1 - picked.exp()) ** 2) * picked).sum())
            cross_entropy += float(-picked.sum())
            tokens += int(keep.sum())
    return focal / tokens, cross_entropy / tokens, sum(len(s["input_ids"]) for s in encoded)


def events(path: Path) -> list[tuple]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(row["event"], row["step"]) for row in rows], rows


def check_sft_run(out: Path, model_dir: Path, events_file: Path) -> None:
    focal, cross_entropy, tokens = focal_and_cross_entropy(model_dir, QA_ROWS)
    first = logged(out)[0]
    # A batch against each sample alone: a mean of focal terms of one sign (the random model's
    # p is far from 1, so (1 - p)^2 does not cancel).
    assert_close(first, focal, terms=forward_terms(tokens), what="step-1 focal loss")
    assert abs(first - cross_entropy) > 100 * abs(first - focal)  # not the built-in loss
    order, rows = events(events_file)
    assert order == [
        ("on_train_start", 0), ("on_step_end", 1), ("on_save", 1),
        ("on_step_end", 2), ("on_save", 2), ("on_train_end", 2),
    ]  # fmt: skip
    saves = [Path(row["path"]) for row in rows if row["event"] == "on_save"]
    assert saves == [out / "checkpoints" / "step-1", out / "checkpoints" / "step-2"]
    assert all((path / "COMPLETE").is_file() for path in saves)
    assert rows[1]["loss"] == first  # the same number handed on
    assert rows[-1]["final_loss"] == logged(out)[-1]


def check_grpo_run(out: Path) -> None:
    completions = [
        json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()
    ]
    assert len(completions) == 8
    for row in completions:  # the plugin's formula, on the text each completion decoded to
        assert row["rewards"] == {"demo_brevity": -len(row["completion"]) / 100}  # Python floats
    mean = sum(row["reward"] for row in completions) / len(completions)
    # A mean of 8 rewards of one sign, float32 against float64.
    logged_mean = logged(out, "rewards/demo_brevity/mean")[0]
    assert_close(logged_mean, mean, terms=len(completions) + 1, what="mean reward")


@pytest.mark.numerics
def test_an_installed_package_adds_a_format_a_loss_and_a_callback_to_sft(
    installed_plugin, tiny_model_dir, tmp_path
):
    data = write_jsonl(tmp_path / "qa.jsonl", QA_ROWS)  # rows in the plugin's format only
    out = tmp_path / "run"
    done = run_swiftlm(
        command("sft", tiny_model_dir, data, out, **sft_flags()), installed_plugin, tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "swiftlm: loaded plugins: entry point 'demo' = swiftlm_demo_plugin "
        "(swiftlm-demo-plugin 0.1.0)" in done.stderr
    )
    check_sft_run(out, tiny_model_dir, tmp_path / "ev")
    assert yaml.safe_load((out / "config.yaml").read_text())["plugins"]["loss_type"] == "demo_focal"


@pytest.mark.numerics
@pytest.mark.usefixtures("isolated_plugins")
def test_an_installed_package_adds_a_reward_to_grpo(
    installed_plugin, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """In this process (the sft test above runs a subprocess): the installed folder on
    sys.path is what importlib.metadata searches for entry points."""
    from swiftlm.plugins import loading

    monkeypatch.syspath_prepend(str(installed_plugin))
    monkeypatch.setattr(loading, "_entry_points_done", False)
    monkeypatch.delitem(sys.modules, "swiftlm_demo_plugin", raising=False)
    data = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    out = tmp_path / "run"
    assert main(command("rlhf", tiny_model_dir, data, out, **GRPO_FLAGS)) == 0
    assert "entry point 'demo' = swiftlm_demo_plugin" in capsys.readouterr().err
    check_grpo_run(out)


@pytest.mark.numerics
@pytest.mark.usefixtures("isolated_plugins")
def test_an_external_plugins_file_does_the_same(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SWIFTLM_DEMO_EVENTS", str(tmp_path / "ev"))
    data = write_jsonl(tmp_path / "qa.jsonl", QA_ROWS)
    out = tmp_path / "sft"
    # The format named (the installed-package test above has it detected).
    flags = sft_flags(external_plugins=PLUGIN_FILE, dataset_format="demo_qa")
    assert main(command("sft", tiny_model_dir, data, out, **flags)) == 0
    assert f"swiftlm: loaded plugins: plugin file {PLUGIN_FILE}" in capsys.readouterr().err
    check_sft_run(out, tiny_model_dir, tmp_path / "ev")
    # config.yaml records the file: a rerun from it loads the plugin before parsing.
    assert yaml.safe_load((out / "config.yaml").read_text())["plugins"]["external_plugins"] == [
        str(PLUGIN_FILE)
    ]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    grpo = command("rlhf", tiny_model_dir, prompts, tmp_path / "grpo", **GRPO_FLAGS)
    assert main([*grpo, "--external_plugins", str(PLUGIN_FILE)]) == 0
    check_grpo_run(tmp_path / "grpo")


DOUBLED = """
import swiftlm.plugins as plugins
from swiftlm.methods.sft import SFT


class DoubledSFT(SFT):
    name = "doubled"

    def loss(self, model, batch):
        loss_sum, metrics = super().loss(model, batch)
        return 2 * loss_sum, metrics


plugins.register_method("doubled", DoubledSFT, rlhf=True)
"""


@pytest.mark.numerics
@pytest.mark.usefixtures("isolated_plugins")
def test_a_plugin_method_runs_as_an_rlhf_type(tiny_model_dir, chat_jsonl, tmp_path, capsys):
    path = tmp_path / "doubled.py"
    path.write_text(DOUBLED)
    flags = dict(max_steps=2, fused_cross_entropy="false")
    assert main(command("sft", tiny_model_dir, chat_jsonl, tmp_path / "sft", **flags)) == 0
    rlhf = command("rlhf", tiny_model_dir, chat_jsonl, tmp_path / "rlhf", **flags)
    assert main([*rlhf, "--rlhf_type", "doubled", "--external_plugins", str(path)]) == 0
    sft_losses, doubled = logged(tmp_path / "sft"), logged(tmp_path / "rlhf")
    # The same untrained model, batches and sums: twice the same number, bit for bit.
    assert doubled[0] == 2 * sft_losses[0]
    with pytest.raises(SystemExit) as done:  # argparse's choices now list the plugin's method
        main([*rlhf, "--rlhf_type", "nope"])
    assert done.value.code == 2
    assert "'gkd', 'doubled')" in capsys.readouterr().err


RAISING = """
import swiftlm.plugins as plugins

def exploding(logits, targets):
    raise RuntimeError("loss blew up")

def failing(completions, **kwargs):
    return [1 / 0 for _ in completions]

plugins.register_loss("exploding", exploding)
plugins.register_reward("failing", failing)
"""


@pytest.mark.bad_input(
    input="A plugin's loss or reward function that raises during training",
    outcome="The run stops with exit 2; the message names the loss or reward, the plugin and the "
    "plugin's file:line, without a traceback",
)
@pytest.mark.usefixtures("isolated_plugins")
def test_a_plugin_raising_at_run_time_stops_the_run_naming_it(
    tiny_model_dir, chat_jsonl, tmp_path, capsys
):
    path = tmp_path / "raising.py"
    path.write_text(RAISING)
    sft = command("sft", tiny_model_dir, chat_jsonl, tmp_path / "sft", max_steps=1)
    assert main([*sft, "--external_plugins", str(path), "--loss_type", "exploding"]) == 2
    err = capsys.readouterr().err
    assert (
        f"loss 'exploding' of plugin file {path} failed at {path}:5: RuntimeError: loss blew up"
        in err
    )
    assert "Traceback" not in err
    prompts = write_jsonl(tmp_path / "prompts.jsonl", PROMPTS)
    flags = {**GRPO_FLAGS, "reward_funcs": "failing", "external_plugins": path}
    assert main(command("rlhf", tiny_model_dir, prompts, tmp_path / "grpo", **flags)) == 2
    assert (
        f"reward function 'failing' of plugin file {path} failed at {path}:8: ZeroDivisionError"
        in capsys.readouterr().err
    )


@pytest.mark.slow
@pytest.mark.usefixtures("isolated_plugins")
def test_torchrun_workers_load_the_plugin_files_and_callbacks_run_on_rank_0(
    tiny_model_dir, tmp_path, monkeypatch, capfd
):
    from serve_helpers import free_port

    monkeypatch.setenv("SWIFTLM_DEMO_EVENTS", str(tmp_path / "ev"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    data = write_jsonl(tmp_path / "qa.jsonl", QA_ROWS)
    out = tmp_path / "ddp"
    flags = sft_flags(external_plugins=PLUGIN_FILE, nproc_per_node=2, master_port=free_port())
    flags["strategy"] = "ddp"
    flags["per_device_train_batch_size"] = 4  # 2 ranks x 4 rows: the same 8-row step
    assert main(command("sft", tiny_model_dir, data, out, **flags)) == 0
    check_sft_run(out, tiny_model_dir, tmp_path / "ev")  # one event per hook: rank 0's
    assert capfd.readouterr().err.count("swiftlm: loaded plugins:") == 1  # the launcher's
