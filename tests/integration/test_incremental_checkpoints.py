"""--incremental_checkpoints: content-addressed blocks shared by a run's checkpoints.

Exact resume from a block checkpoint, blocks of frozen weights written once, pruning that
keeps every remaining checkpoint loadable, and a clear error where a block checkpoint is
given as weights to load (`swiftlm infer --ckpt_dir`).
"""

import json
from pathlib import Path

import pytest
import torch

from conftest import stopped_at, tiny_sft
from swiftlm.checkpoint import blocks
from swiftlm.checkpoint.tensors import read_optimizer, read_weights
from swiftlm.cli.main import main
from tolerance import assert_same_weights

FULL_FROZEN_EMBEDDINGS = dict(
    train_type="full",
    freeze_parameters="model.embed_tokens",
    learning_rate="1e-3",
    max_steps=6,
    save_steps=2,
    incremental_checkpoints="true",
)
WEIGHTS = "model.safetensors"


def block_hashes(folder: Path, group: str, name: str) -> list[str]:
    """The blocks of the stream part holding tensor `name` of `group`."""
    layout = blocks.read_manifest(folder)["groups"][group]
    entry, start, found = layout["tensors"][name], 0, []
    for digest, size in layout["blocks"]:
        if start < entry["offset"] + entry["nbytes"] and entry["offset"] < start + size:
            found.append(digest)
        start += size
    return found


@pytest.fixture(scope="module")
def frozen_run(tiny_model_dir, tmp_path_factory) -> Path:
    """Full fine-tuning of the tiny Llama with frozen embeddings, checkpoints in blocks."""
    from conftest import CHAT_ROWS, write_jsonl

    root = tmp_path_factory.mktemp("incremental")
    data = write_jsonl(root / "chat.jsonl", CHAT_ROWS)
    assert main(tiny_sft(tiny_model_dir, data, root / "run", **FULL_FROZEN_EMBEDDINGS)) == 0
    return root / "run"


def test_resume_from_a_block_checkpoint_equals_the_uninterrupted_run(
    frozen_run, tiny_model_dir, tmp_path
):
    step2 = frozen_run / "checkpoints" / "step-2"
    assert (step2 / "COMPLETE").is_file() and (step2 / blocks.MANIFEST).is_file()
    # No weights or optimizer safetensors in the folder: they are blocks in the store.
    assert not list(step2.glob("model*.safetensors")) and not list(step2.glob("optimizer.s*"))
    # final/ is the standard format, loadable by transformers.
    assert (frozen_run / "final" / WEIGHTS).is_file()
    resumed = stopped_at(frozen_run, 2, tmp_path / "resumed")
    flags = dict(FULL_FROZEN_EMBEDDINGS, resume_from_checkpoint="auto")
    assert main(tiny_sft(tiny_model_dir, frozen_run.parent / "chat.jsonl", resumed, **flags)) == 0
    a, b = frozen_run / "final" / WEIGHTS, resumed / "final" / WEIGHTS
    assert_same_weights(a, b)
    # The frozen embeddings never moved.
    from safetensors.torch import load_file

    base = load_file(tiny_model_dir / WEIGHTS)["model.embed_tokens.weight"]
    assert torch.equal(load_file(a)["model.embed_tokens.weight"], base)


def test_blocks_of_frozen_weights_are_written_once(frozen_run):
    step2, step4 = (frozen_run / "checkpoints" / f"step-{n}" for n in (2, 4))
    embedding = "model.embed_tokens.weight"
    frozen = block_hashes(step2, blocks.MODEL_GROUP, embedding)
    assert frozen and frozen == block_hashes(step4, blocks.MODEL_GROUP, embedding)
    trained = "model.layers.0.mlp.down_proj.weight"
    assert block_hashes(step2, "model", trained) != block_hashes(step4, "model", trained)
    # Not rewritten: the embedding's block files are older than step 4's manifest.
    store = blocks.store_of(step2)
    manifest_time = (step4 / blocks.MANIFEST).stat().st_mtime_ns
    assert all(blocks.block_path(store, d).stat().st_mtime_ns < manifest_time for d in frozen)
    # One file per distinct block: the store holds each shared block once.
    sizes = {}
    for folder in (frozen_run / "checkpoints").glob("step-*"):
        for layout in blocks.read_manifest(folder)["groups"].values():
            sizes.update(dict(map(tuple, layout["blocks"])))
    assert sum(p.stat().st_size for p in store.glob("??/*.bin")) == sum(sizes.values())
    # The frozen embedding has no optimizer state: only trained weights have blocks there.
    assert read_optimizer(step4)["state"]


def test_the_store_writes_only_changed_blocks(tmp_path, monkeypatch):
    """Bytes written by a second save where one of three tensors changed."""
    monkeypatch.setattr(blocks, "BLOCK_SIZE", 64 * 1024)
    torch.manual_seed(0)
    frozen = torch.randn(100_000)  # 400 KB: 7 blocks of its own
    moving = torch.randn(50_000)  # 200 KB: its own 4 blocks
    small = torch.zeros(10, dtype=torch.bfloat16)
    first, second = tmp_path / "step-1", tmp_path / "step-2"
    first.mkdir(), second.mkdir()
    stats = blocks.write_block_checkpoint(first, {"model": {"a": frozen, "b": moving, "c": small}})
    assert stats.blocks_written == 7 + 4 + 1 and stats.bytes_written > 600_000
    stats = blocks.write_block_checkpoint(
        second, {"model": {"a": frozen, "b": moving * 2, "c": small}}
    )
    assert (stats.blocks_written, stats.blocks_reused) == (4, 8)
    assert stats.bytes_written == 200_000
    back = read_weights(second)
    assert torch.equal(back["a"], frozen) and torch.equal(back["b"], moving * 2)
    assert back["c"].dtype == torch.bfloat16 and torch.equal(back["c"], small)


def test_garbage_collection_keeps_blocks_of_every_remaining_folder(tmp_path):
    """A folder without COMPLETE (a save in flight) keeps its blocks too; unreferenced go."""
    root = tmp_path / "checkpoints"
    folders = [root / f"step-{n}" for n in (1, 2, 3)]
    for n, folder in enumerate(folders):
        folder.mkdir(parents=True)
        blocks.write_block_checkpoint(folder, {"model": {"w": torch.full((20_000,), float(n))}})
    (folders[1] / "COMPLETE").write_text("step 2\n")  # step-3 stays in flight
    import shutil

    shutil.rmtree(folders[0])
    removed, freed = blocks.collect_garbage(root)
    assert removed == 1 and freed == 80_000
    on_disk = {p.stem for p in blocks.store_of(folders[1]).glob("??/*.bin")}
    assert on_disk == blocks.referenced_blocks(folders[1]) | blocks.referenced_blocks(folders[2])
    for folder, n in zip(folders[1:], (1, 2), strict=True):
        assert torch.equal(read_weights(folder)["w"], torch.full((20_000,), float(n)))
    needed = blocks.checkpoint_files(folders[2])
    assert folders[2] / blocks.MANIFEST in needed and all(p.is_file() for p in needed)
    assert sum(p.parent.parent == blocks.store_of(folders[2]) for p in needed) == 1


def test_pruning_keeps_every_remaining_checkpoint_loadable(tiny_model_dir, chat_jsonl, tmp_path):
    flags = dict(FULL_FROZEN_EMBEDDINGS, save_steps=1, max_steps=5, save_total_limit=2)
    run = tmp_path / "run"
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, run, **flags)) == 0
    kept = sorted(p.name for p in (run / "checkpoints").glob("step-*"))
    assert kept == ["step-4", "step-5"]
    store = run / "checkpoints" / blocks.STORE
    referenced = set().union(*(blocks.referenced_blocks(run / "checkpoints" / k) for k in kept))
    assert {p.stem for p in store.glob("??/*.bin")} == referenced  # pruned blocks deleted
    # The last checkpoint holds the final weights; the other resumes to the same end.
    from safetensors.torch import load_file

    final = load_file(run / "final" / WEIGHTS)
    saved = read_weights(run / "checkpoints" / "step-5")
    assert max((saved[k] - final[k]).abs().max().item() for k in final) == 0
    resumed = stopped_at(run, 4, tmp_path / "from-4")
    flags["resume_from_checkpoint"] = "auto"
    assert main(tiny_sft(tiny_model_dir, chat_jsonl, resumed, **flags)) == 0
    assert_same_weights(run / "final" / WEIGHTS, resumed / "final" / WEIGHTS)


@pytest.mark.bad_input(
    input="swiftlm infer --ckpt_dir <an incremental (block-format) checkpoint>",
    outcome="CheckpointError naming the block format and what to load instead; exit 1",
)
def test_infer_refuses_a_block_checkpoint_clearly(frozen_run, capsys):
    step = frozen_run / "checkpoints" / "step-4"
    code = main(["infer", "--ckpt_dir", str(step), "--max_new_tokens", "2"])
    err = capsys.readouterr().err
    assert code == 1
    assert "incremental checkpoint" in err and f"--ckpt_dir {frozen_run}" in err
    assert json.loads((step / "trainer_state.json").read_text())["step"] == 4


@pytest.mark.bad_input(
    input="--incremental_checkpoints true --fsdp fsdp2 (or tp, pp, deepspeed)",
    outcome="ConfigError naming the strategy: blocks are for one process or DDP; exit 2",
)
def test_incremental_checkpoints_refused_for_sharded_engines(tiny_model_dir, chat_jsonl, capsys):
    argv = tiny_sft(tiny_model_dir, chat_jsonl, Path("/nonexistent/run"))
    assert main([*argv, "--incremental_checkpoints", "true", "--fsdp", "fsdp2"]) == 2
    assert "FSDP2 writes its own checkpoint format" in capsys.readouterr().err
    from swiftlm.config.commands import TrainConfig
    from swiftlm.config.rules import failures
    from swiftlm.distributed.config import DistArguments

    for flags, engine in (
        (dict(deepspeed="zero2"), "DeepSpeed"),
        (dict(pipeline_parallel_size=2), "pipeline parallel"),
        (dict(tensor_parallel_size=2), "tensor parallel"),
    ):
        config = TrainConfig(dist=DistArguments(incremental_checkpoints=True, **flags))
        broken = dict(failures(config))
        assert engine in broken["incremental_checkpoints_need_ddp"]
    ddp = TrainConfig(dist=DistArguments(incremental_checkpoints=True, nproc_per_node=2))
    assert "incremental_checkpoints_need_ddp" not in dict(failures(ddp))
