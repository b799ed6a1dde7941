"""`swiftlm plan` end to end on a tiny model folder, and `--strategy auto` choosing from it."""

import json

import pytest
import yaml

from conftest import tiny_sft
from swiftlm.cli.main import main
from swiftlm.plan.devices import GIB

PLAN = ["--train_type", "full", "--max_length", "128", "--per_device_train_batch_size", "2"]


def test_plan_prints_every_layout_and_recommends_the_fastest_that_fits(tiny_model_dir, capsys):
    assert main(["plan", "--model", str(tiny_model_dir), *PLAN, "--devices", "4xA100-80G"]) == 0
    out = capsys.readouterr().out
    assert "weights    grads    optim    activ   logits  buffers     peak   step s" in out
    rows = {line[2:24].strip(): line for line in out.splitlines() if line[:2] in ("* ", "  ")}
    for name in (
        "DDP",
        "ZeRO-1",
        "ZeRO-2",
        "ZeRO-3",
        "ZeRO-3 + offload",
        "FSDP2",
        "TP2 x FSDP2 dp2",
    ):
        assert name in rows, name
    # the tiny model has 2 key/value heads: TP4 cannot split them; PP needs micro-batches
    assert "TP4" in rows and "key/value heads (2) are not divisible by 4" in rows["TP4"]
    assert "fewer micro-batches than 2 stages" in rows["PP2"]
    from transformers import AutoModelForCausalLM

    params = AutoModelForCausalLM.from_pretrained(tiny_model_dir).num_parameters()
    ddp_weights = float(rows["DDP"][24:].split()[0])
    assert ddp_weights == pytest.approx(params * 4 / GIB, abs=0.006)  # fp32 weights, replicated
    starred = next(line for line in out.splitlines() if line.startswith("* "))
    assert f"Recommended: {starred[2:24].strip()} (" in out
    assert "Runner-up: " in out


def test_plan_json_for_machines(tiny_model_dir, capsys, tmp_path):
    argv = ["plan", "--model", str(tiny_model_dir), *PLAN, "--devices", "8xH100", "--nnodes", "2"]
    assert main([*argv, "--output_json", "-"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["world_size"] == 16 and plan["devices"] == "8x H100 SXM 80GB x 2 nodes"
    fastest = min(
        (c for c in plan["candidates"] if c["fits"]), key=lambda c: c["step_seconds"]["total"]
    )
    assert plan["recommended"] == fastest["layout"]
    ddp = next(c for c in plan["candidates"] if c["layout"] == "DDP")
    assert ddp["flags"] == ["--strategy", "ddp"] and ddp["step_seconds"]["communication"] > 0


@pytest.mark.bad_input(
    input="swiftlm plan --devices naming a device the planner does not know",
    outcome="Exit code 2 and a message naming --devices, the value and the known devices",
)
def test_plan_with_an_unknown_device_is_a_config_error(tiny_model_dir, capsys):
    assert main(["plan", "--model", str(tiny_model_dir), "--devices", "8xTPUv5"]) == 2
    err = capsys.readouterr().err
    assert "--devices 8xTPUv5" in err and "H100" in err and "MI300X" in err


def test_a_missing_model_path_is_named(tmp_path, capsys):
    """Not taken for a hub id: the folder is named as missing."""
    missing = tmp_path / "no-such-model"
    assert main(["plan", "--model", str(missing), "--devices", "8xH100"]) == 1
    assert f"--model {missing}: not a model folder or .gguf file" in capsys.readouterr().err


def test_strategy_auto_replaces_itself_with_the_plans_flags(tiny_model_dir, monkeypatch, capsys):
    from swiftlm.config import TrainConfig
    from swiftlm.config.parse import parse_config
    from swiftlm.plan import auto
    from swiftlm.plan.devices import parse_devices

    monkeypatch.setattr(auto, "local_cluster", lambda cfg: parse_devices("2xA100-80G"))
    argv = ["--model", str(tiny_model_dir), "--dataset", "x.jsonl", "--nproc_per_node", "2"]
    argv += ["--strategy", "auto"]
    cfg = parse_config(TrainConfig, argv, "swiftlm sft", "")
    planned = auto.resolve_auto_strategy(cfg, "sft", argv)
    line = capsys.readouterr().out
    assert line.startswith("--strategy auto: ") and "runner-up" in line
    assert "--strategy" not in planned[: len(argv) - 2] and planned[: len(argv) - 2] == argv[:-2]
    flags = planned[len(argv) - 2 :]
    assert flags and f"({' '.join(flags)})" in line
    # only data-parallel layouts: TP/PP would change the job's global batch
    assert not {"--tensor_parallel_size", "--pipeline_parallel_size"} & set(flags)
    # explicit engines, one process and other commands are left alone
    for extra in (["--deepspeed", "zero2"], ["--fsdp", "fsdp2"]):
        cfg = parse_config(TrainConfig, [*argv, *extra], "swiftlm sft", "")
        assert auto.resolve_auto_strategy(cfg, "sft", argv) == argv
    one = parse_config(TrainConfig, argv[:4], "swiftlm sft", "")
    assert auto.resolve_auto_strategy(one, "sft", argv[:4]) == argv[:4]


def test_strategy_auto_shards_when_ddp_does_not_fit(tiny_model_dir, monkeypatch, capsys):
    """A budget between the sharded layouts' estimate and DDP's: a sharded layout is chosen."""
    from swiftlm.config import TrainConfig
    from swiftlm.config.parse import parse_config
    from swiftlm.plan import auto
    from swiftlm.plan.devices import GIB, parse_devices
    from swiftlm.plan.run import plan_for

    argv = ["--model", str(tiny_model_dir), "--dataset", "x.jsonl", "--nproc_per_node", "8"]
    argv += ["--train_type", "full", "--torch_dtype", "bfloat16"]
    cfg = parse_config(TrainConfig, argv, "swiftlm sft", "")
    roomy = plan_for(cfg, parse_devices("8xA100-80G"))
    peaks = {c.layout.name: c.memory.peak / GIB for c in roomy.candidates}
    budget = (peaks["DDP"] + peaks["ZeRO-3"]) / 2
    assert peaks["ZeRO-3"] < budget < peaks["DDP"]
    monkeypatch.setattr(
        auto, "local_cluster", lambda cfg: parse_devices("8xA100-80G", 1, budget / 0.9)
    )
    planned = auto.resolve_auto_strategy(cfg, "sft", argv)
    assert planned[len(argv) :] != ["--strategy", "ddp"], capsys.readouterr().out
    assert "--strategy auto: " in capsys.readouterr().out


@pytest.mark.slow
def test_strategy_auto_with_two_processes_runs_the_planned_layout(
    tiny_model_dir, chat_jsonl, tmp_path, capsys
):
    out = tmp_path / "auto"
    argv = tiny_sft(tiny_model_dir, chat_jsonl, out, max_steps=2, nproc_per_node=2)
    assert main([*argv, "--master_port", "30161", "--strategy", "auto"]) == 0
    printed = capsys.readouterr().out
    line = next(ln for ln in printed.splitlines() if ln.startswith("--strategy auto: "))
    flags = line.split("(", 1)[1].split(")", 1)[0].split()
    assert "Launching: torchrun" in printed and " ".join(flags) in printed
    saved = yaml.safe_load((out / "config.yaml").read_text())["dist"]
    values = dict(zip(flags[::2], flags[1::2], strict=False))
    for flag, value in values.items():  # every worker parsed the planned flags
        assert str(saved[flag.removeprefix("--")]).lower() == value.lower(), (flag, saved)
    assert (out / "final").is_dir()


@pytest.mark.bad_input(
    input="`swiftlm plan --model` a vision-language model (or `--strategy auto` with one)",
    outcome="Exit 2 saying the planner models text LMs only and naming the strategy flags; "
    "--strategy auto says it could not plan and uses DDP",
)
def test_a_vision_language_model_is_not_planned(tmp_path, capsys):
    from vlm_helpers import build_llava

    folder = build_llava(tmp_path / "llava")
    assert main(["plan", "--model", str(folder), "--devices", "2xA100-80G"]) == 2
    err = capsys.readouterr().err
    assert "vision-language model (llava)" in err and "--strategy" in err
