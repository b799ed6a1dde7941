"""Elastic membership without processes: the data order and positions across data-parallel
sizes, the gradient accumulation that keeps the global batch, the resume checks, and the
torchrun command of an elastic job (the slow test_elastic_membership.py runs one)."""

import sys

import pytest

from swiftlm.config import TrainConfig, parse_config
from swiftlm.config.rules import failures
from swiftlm.distributed.config import DistArguments
from swiftlm.distributed.launch import elastic_argv, torchrun_command, worker_environment
from swiftlm.errors import CheckpointError, ConfigError
from swiftlm.train.batching import (
    DataPosition,
    build_batch_plan,
    convert_position,
    iterate_steps,
    micro_batch_units,
)
from swiftlm.train.elastic import (
    accumulation_for,
    batch_record,
    planned_shape,
    resumed_position,
)
from swiftlm.train.resume_match import differences

LENGTHS = [3 + (i * 7) % 11 for i in range(37)]  # 37 samples: epochs end in short batches


def plan(dp_size: int, batch_size: int = 2, **kw):
    return build_batch_plan(LENGTHS, batch_size, dp_size, seed=5, **kw)


def rows_of_steps(dp_size: int, accumulation: int, steps: int, start=DataPosition(), **kw):
    """The rows each optimizer step reads, in order (ranks flattened), and the positions."""
    iterator = iterate_steps(plan(dp_size, **kw), accumulation, start)
    out = []
    for _ in range(steps):
        batches, position = next(iterator)
        out.append(([row for g in batches for rank in g for row in rank], position))
    return out


LAYOUTS = {
    "fixed size": {},
    "packed": {"pack_to": 24},
    "token budget": {"max_tokens": 30},
}


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_a_step_reads_the_same_rows_in_the_same_order_on_any_number_of_ranks(layout):
    # Global batch: 2 rows x 4 ranks x 1 = 2 x 2 x 2 = 2 x 1 x 4 (budget: micro-batches).
    four = rows_of_steps(4, 1, 12, **LAYOUTS[layout])
    two = rows_of_steps(2, 2, 12, **LAYOUTS[layout])
    one = rows_of_steps(1, 4, 12, **LAYOUTS[layout])
    assert [rows for rows, _ in four] == [rows for rows, _ in two] == [rows for rows, _ in one]
    assert four[4][0] != four[5][0]  # they cross an epoch: 37 rows make 5 steps of 8
    # The same place in the epoch: micro-batch index x units per global micro-batch.
    units = [micro_batch_units(plan(n, **LAYOUTS[layout])) for n in (4, 2, 1)]
    for (_, p4), (_, p2), (_, p1) in zip(four, two, one, strict=True):
        assert p4.epoch == p2.epoch == p1.epoch
        assert p4.micro_batch * units[0] == p2.micro_batch * units[1] == p1.micro_batch * units[2]


def test_a_position_converts_by_the_rows_consumed():
    # 3 global micro-batches of 2 ranks x 2 rows are 12 rows: 6 micro-batches of 1 rank x 2.
    assert convert_position(DataPosition(1, 3), 4, 2) == DataPosition(1, 6)
    assert convert_position(DataPosition(1, 6), 2, 4) == DataPosition(1, 3)
    with pytest.raises(ValueError, match="12 rows .* not a whole number of global micro-batches"):
        convert_position(DataPosition(0, 3), 4, 8)


def test_a_resume_on_fewer_ranks_continues_with_the_next_rows():
    before = rows_of_steps(2, 2, 5)
    rows_done, saved_at = before[2][0], before[2][1]  # the checkpoint after step 3
    saved = {"epoch": saved_at.epoch, "micro_batch": saved_at.micro_batch}
    saved.update(batch_record(plan(2), args(2, 2), dp_size=2))
    one_rank = plan(1)
    position = resumed_position(saved, one_rank, "step-3", print)
    assert position == DataPosition(saved_at.epoch, 2 * saved_at.micro_batch)
    after = rows_of_steps(1, 4, 2, start=position)
    assert [rows for rows, _ in after] == [rows for rows, _ in before[3:5]]
    assert rows_done not in [rows for rows, _ in after]


def test_a_position_inside_a_bigger_micro_batch_is_refused():
    saved = {"epoch": 0, "micro_batch": 3, "micro_batch_units": 2}
    with pytest.raises(CheckpointError, match="step-9: its data position.*resume on"):
        resumed_position(saved, plan(2), "step-9", print)  # 6 rows, micro-batches of 4
    older = {"epoch": 0, "micro_batch": 3}  # written before positions had units: as it is
    assert resumed_position(older, plan(2), "step-9", print) == DataPosition(0, 3)


def args(batch_size: int, accumulation: int):
    return parse_config(
        TrainConfig,
        ["--per_device_train_batch_size", str(batch_size)]
        + ["--gradient_accumulation_steps", str(accumulation)],
        "swiftlm sft",
    ).train


def elastic(*flags) -> TrainConfig:
    argv = ["--dataset", "d.jsonl", "--output_dir", "run", "--nnodes", "1:4", *map(str, flags)]
    return parse_config(TrainConfig, argv, "swiftlm sft")


def test_gradient_accumulation_keeps_the_global_batch_of_the_largest_size():
    # 2 processes per node, up to 4 nodes, 2 rows each, accumulation 1 at full size: 16 rows.
    cfg = elastic("--nproc_per_node", 2, "--per_device_train_batch_size", 2)
    assert planned_shape(cfg, world_size=2).size == 16
    assert [accumulation_for(16, cfg, world) for world in (8, 4, 2)] == [1, 2, 4]
    with pytest.raises(ConfigError, match=r"global batch 16 rows .* 6 processes: 2 per device x 6"):
        accumulation_for(16, cfg, 6)
    # A token budget counts budget micro-batches: 1 per rank.
    budget = elastic("--nproc_per_node", 2, "--max_tokens_per_batch", 4096)
    assert planned_shape(budget, 4).size == 8 and accumulation_for(8, budget, 2) == 4


def saved_flags(**flags) -> dict:
    base = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 1}
    return {**base, **flags}


def now(*flags) -> TrainConfig:
    """A config of 2 rows per device unless `flags` say otherwise."""
    batch = (
        [] if "--per_device_train_batch_size" in flags else ["--per_device_train_batch_size", "2"]
    )
    argv = ["--dataset", "d.jsonl", *batch, *map(str, flags)]
    return parse_config(TrainConfig, argv, "swiftlm sft")


def test_a_resume_may_change_the_ranks_when_the_global_batch_stays():
    # Saved by 2 ranks x 2 rows x 1 step: 1 rank x 2 rows x 2 steps is the same 4 rows.
    assert differences(saved_flags(), now("--gradient_accumulation_steps", 2), (2, 1)) == []
    assert differences(saved_flags(), now("--per_device_train_batch_size", 4), (2, 1)) == []
    assert differences(saved_flags(), now(), (2, 1)) == [
        "global batch: saved 4 rows per step, now 2 rows per step (2 per device x 1 "
        "data-parallel rank x 1 accumulation); --gradient_accumulation_steps 2 keeps it"
    ]
    # The checkpoint's record wins over config.yaml (an elastic job rewrites the latter).
    assert differences(saved_flags(), now(), (2, 1), saved_global=2) == []
    budget = ["--max_tokens_per_batch", 4096]
    saved = saved_flags(max_tokens_per_batch=4096)
    assert differences(saved, now(*budget, "--gradient_accumulation_steps", 2), (2, 1)) == []
    assert differences(saved, now(*budget), (2, 1)) == [
        "global batch: saved 2 budget micro-batches per step, now 1 budget micro-batches per "
        "step (1 data-parallel rank x 1 accumulation); --gradient_accumulation_steps 2 keeps it"
    ]


def test_an_elastic_job_launches_torchrun_with_a_c10d_rendezvous():
    dist = DistArguments(nnodes="1:2", rdzv_endpoint="10.0.0.1:30059", rdzv_conf="join_timeout=9")
    command = torchrun_command(dist, "sft", ["--output_dir", "/runs/a"], "/runs/a")
    assert command[:3] == [sys.executable, "-m", "swiftlm.distributed.torchrun"]
    assert command[3:10] == [
        "--nproc_per_node=1",
        "--nnodes=1:2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=10.0.0.1:30059",
        command[7],
        "--rdzv_conf=join_timeout=9",
        "--max_restarts=3",  # the elastic default: a node that leaves costs one
    ]
    assert command[7].startswith("--rdzv_id=swiftlm-")  # the same for the same --output_dir
    assert command[7] == torchrun_command(dist, "sft", [], "/runs/a")[7]
    assert command[7] != torchrun_command(dist, "sft", [], "/runs/b")[7]
    assert elastic_argv(["--x", "1"]) == ["--x", "1", "--resume_from_checkpoint", "auto"]
    assert elastic_argv(["--resume_from_checkpoint=auto"]) == ["--resume_from_checkpoint=auto"]
    assert worker_environment(dist)["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    static = torchrun_command(DistArguments(nnodes="2"), "sft", [], None)
    assert "--node_rank=0" in static and "--max_restarts=0" in static
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in worker_environment(DistArguments())


@pytest.mark.bad_input(
    input="--nnodes that is not N or MIN:MAX with 1 <= MIN <= MAX (2:1, 0, a:b)",
    outcome="A config error naming the value and the accepted forms",
)
@pytest.mark.parametrize("value", ["2:1", "0", "a:b", "1:2:3"])
def test_a_bad_node_range_is_refused(value):
    with pytest.raises(ConfigError, match=f"--nnodes {value}: give a node count N >= 1, or MIN"):
        DistArguments(nnodes=value)


@pytest.mark.bad_input(
    input="--nnodes MIN:MAX without --output_dir, with --add_version/--overwrite_output_dir, "
    "or with --resume_from_checkpoint naming a checkpoint",
    outcome="A config error: an elastic job continues the run in one --output_dir at every "
    "membership change, naming the flag to drop or add",
)
def test_an_elastic_job_keeps_one_run_directory():
    def broken(*flags) -> list[str]:
        argv = ["--dataset", "d.jsonl", "--nnodes", "1:2", *flags]
        return [name for name, _ in failures(parse_config(TrainConfig, argv, "swiftlm sft"))]

    assert broken() == ["elastic_needs_output_dir"]
    assert broken("--output_dir", "r", "--add_version", "true") == ["elastic_keeps_its_run"]
    assert broken("--output_dir", "r", "--resume_from_checkpoint", "r/checkpoints/step-2") == [
        "elastic_resumes_its_run"
    ]
    assert broken("--output_dir", "r", "--resume_from_checkpoint", "auto") == []


def test_a_lost_peer_is_one_line_and_each_membership_change_a_new_attempt(
    monkeypatch, tmp_path, capsys
):
    from swiftlm.distributed import failures

    for name, value in {
        failures.FAILURE_DIR_ENV: str(tmp_path),
        failures.ELASTIC_ENV: "1",
        "RANK": "0",
        "TORCHELASTIC_RESTART_COUNT": "1",
        "MASTER_PORT": "40001",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    failures.install_crash_hook()
    lost = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:13008. GLHF")
    sys.excepthook(RuntimeError, lost, None)
    assert capsys.readouterr().err == (
        "[rank 0] a node left the job (RuntimeError: [pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:13008. GLHF); the elastic agent restarts the workers at the new size\n"
    )
    # A node joined: torchrun restarts the workers without counting a restart, their rank 0
    # hosts a new store. Their crash is theirs, not an echo of the earlier failure.
    monkeypatch.setenv("MASTER_PORT", "40002")
    sys.excepthook(KeyError, KeyError("q_proj"), None)
    assert "KeyError: 'q_proj'" in capsys.readouterr().err
    assert [f.attempt for f in failures.read_failures(tmp_path)] == ["1-40001", "1-40002"]


def test_deepspeed_state_of_another_world_size_goes_through_the_universal_format(tmp_path):
    from types import SimpleNamespace

    from swiftlm.checkpoint.deepspeed_universal import needs_universal

    state = tmp_path / "deepspeed" / "state"
    state.mkdir(parents=True)
    for rank in (0, 1):  # what ZeRO-1/2/3 on 2 ranks write
        (state / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(b"")

    def engine(stage: int, ranks: int):
        return SimpleNamespace(zero_optimization_stage=lambda: stage, dp_world_size=ranks)

    assert [needs_universal(state, engine(stage, 1)) for stage in (1, 2, 3)] == [True] * 3
    assert not needs_universal(state, engine(2, 2))  # the same world reads it as it is
    assert not needs_universal(state, engine(0, 1))  # no ZeRO: nothing partitioned
