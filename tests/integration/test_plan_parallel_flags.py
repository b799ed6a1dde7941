"""`swiftlm plan` with sequence and expert parallel: the layouts' flags are ones the training
command's rules accept, the table shows them, and `--strategy auto` plans under them."""

import pytest

from swiftlm.cli.main import main
from swiftlm.config import TrainConfig
from swiftlm.config.parse import parse_config
from swiftlm.config.rules import failures
from swiftlm.plan.devices import parse_devices
from swiftlm.plan.run import plan_for


def train_config(model_dir, world: int, *flags: str):
    argv = ["--model", str(model_dir), "--dataset", "x.jsonl", "--nproc_per_node", str(world)]
    return parse_config(TrainConfig, [*argv, "--train_type", "full", *flags], "swiftlm sft", "")


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_moe_dir"])
def test_every_planned_layout_passes_the_training_rules(model, world, request):
    model_dir = request.getfixturevalue(model)
    plan = plan_for(train_config(model_dir, world), parse_devices(f"{world}xA100-80G"))
    names = [c.layout.name for c in plan.candidates]
    assert any(c.layout.sp > 1 for c in plan.candidates), names
    if model == "tiny_moe_dir":
        assert any(c.layout.ep > 1 for c in plan.candidates), names
    for candidate in plan.candidates:
        flags = candidate.layout.sft_flags()
        cfg = train_config(model_dir, world, *flags)
        assert failures(cfg) == [], (candidate.layout.name, flags)


def test_plan_prints_sequence_and_expert_parallel_rows(tiny_moe_dir, capsys):
    argv = ["plan", "--model", str(tiny_moe_dir), "--train_type", "full", "--max_length", "4096"]
    assert main([*argv, "--devices", "4xA100-80G"]) == 0
    out = capsys.readouterr().out
    rows = {line[2:24].strip(): line for line in out.splitlines() if line[:2] in ("* ", "  ")}
    for name in (
        "SP2 x DDP dp2",
        "SP2 ring x FSDP2 dp2",
        "SP4 ring x DDP",
        "DDP + EP2",
        "DDP + EP4",
    ):
        assert name in rows, name
    assert "8 experts top 2 in 2 layers" in out
    assert "SPn: n ranks share each row, ceil(max_length / n) + 1 tokens" in out
    assert "EPn: n data-parallel ranks share out each MoE layer's experts" in out
    # per rank, SP2 holds about half of DDP's activations (the look-ahead aside)
    ddp, sp2 = (float(rows[name][24:].split()[3]) for name in ("DDP", "SP2 x DDP dp2"))
    assert sp2 == pytest.approx(ddp / 2, abs=0.02)


def test_strategy_auto_plans_under_the_sizes_asked_for(tiny_moe_dir, monkeypatch, capsys):
    """With --sequence_parallel_size or --expert_parallel_size, auto picks how the replicas
    hold the state among the layouts of those sizes; without them it adds neither."""
    from swiftlm.plan import auto

    monkeypatch.setattr(auto, "local_cluster", lambda cfg: parse_devices("4xA100-80G"))
    for sizes, name in (
        (["--sequence_parallel_size", "2"], "SP2 "),
        (["--sequence_parallel_size", "4"], "SP4 ring"),  # 2 key/value heads: auto is the ring
        (["--expert_parallel_size", "2"], "DDP + EP2"),
        ([], ""),
    ):
        argv = ["--model", str(tiny_moe_dir), "--dataset", "x.jsonl", "--nproc_per_node", "4"]
        argv += ["--train_type", "full", *sizes, "--strategy", "auto"]
        cfg = parse_config(TrainConfig, argv, "swiftlm sft", "")
        planned = auto.resolve_auto_strategy(cfg, "sft", argv)
        line = capsys.readouterr().out
        assert line.startswith(f"--strategy auto: {name}"), line
        if not sizes:
            assert "SP" not in line.split(";")[0] and "EP" not in line.split(";")[0], line
        added = planned[len(argv) - 2 :]
        assert added in (["--strategy", "ddp"], ["--fsdp", "fsdp2"]) or added[0] == "--deepspeed"
        final = parse_config(TrainConfig, planned, "swiftlm sft", "")
        assert failures(final) == [], (planned, failures(final))
