"""Checkpoint tiers (`checkpoint/tiers.py`) and the mirror (`checkpoint/mirror.py`) on
folders and fsspec's in-memory filesystem: which checkpoint `auto` takes across tiers, that
a torn copy in any tier is never taken, the mirror's uploads, downloads, pruning and
failures, and the flags' checks. Nothing here trains."""

import json
import time
from pathlib import Path
from types import SimpleNamespace

import fsspec
import pytest

from swiftlm.checkpoint.folders import COMPLETE, checkpoint_dir
from swiftlm.checkpoint.mirror import BackgroundMirror, Mirror
from swiftlm.checkpoint.tiers import (
    LOCAL_TIER,
    MIRROR_TIER,
    RUN_TIER,
    Tiers,
    default_local_dir,
    fetch_url,
    tier_due,
)
from swiftlm.config import TrainConfig, parse_config
from swiftlm.config.rules import failures
from swiftlm.errors import CheckpointError, ConfigError


def fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    """A checkpoint folder with two files (one in a subfolder) and maybe COMPLETE."""
    folder = checkpoint_dir(root, step)
    (folder / "dcp").mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    (folder / "dcp" / "shard.bin").write_bytes(bytes([step]) * 100)
    if complete:
        (folder / COMPLETE).write_text(f"step {step}\n")
    return folder


def output(**flags) -> SimpleNamespace:
    base = dict(
        save_steps=10,
        save_total_limit=None,
        local_save_steps=None,
        local_save_dir=None,
        local_save_total_limit=2,
        checkpoint_mirror=None,
        checkpoint_mirror_options=None,
    )
    return SimpleNamespace(**{**base, **flags})


@pytest.fixture
def mirror_url(request):
    """A fresh in-memory mirror URL per test (fsspec's memory filesystem is global)."""
    url = f"memory://bucket/{request.node.name}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/bucket/{request.node.name}"):
        fs.rm(f"/bucket/{request.node.name}", recursive=True)


def test_steps_go_to_the_run_directory_first_then_the_local_tier():
    out = output(save_steps=10, local_save_steps=4)
    due = {step: tier_due(out, step, last=step == 22) for step in range(1, 23)}
    assert [s for s, t in due.items() if t == RUN_TIER] == [10, 20, 22]
    assert [s for s, t in due.items() if t == LOCAL_TIER] == [4, 8, 12, 16]
    assert tier_due(output(save_steps=10), 4, last=False) is None


def test_auto_takes_the_newest_complete_checkpoint_across_tiers(tmp_path, mirror_url):
    run, local = tmp_path / "run", tmp_path / "shm"
    fake_checkpoint(run, 10)
    fake_checkpoint(local, 14)
    fake_checkpoint(local, 16, complete=False)  # torn local copy: never taken
    tiers = Tiers(output(local_save_steps=2, local_save_dir=str(local)), run, 0, print)
    found, skipped = tiers.newest()
    assert (found.step, found.tier, found.folder) == (14, LOCAL_TIER, checkpoint_dir(local, 14))
    assert skipped == [checkpoint_dir(local, 16)]

    mirror = Mirror(mirror_url)
    mirror.upload(fake_checkpoint(tmp_path / "elsewhere", 18))
    torn = fake_checkpoint(tmp_path / "elsewhere", 20)
    mirror.upload(torn)
    mirror.fs.rm_file(f"{mirror.remote(20)}/{COMPLETE}")  # a copy cut short
    flags = output(local_save_steps=2, local_save_dir=str(local), checkpoint_mirror=mirror_url)
    found, skipped = Tiers(flags, run, 0, print).newest()
    assert (found.step, found.tier, found.folder) == (18, MIRROR_TIER, None)
    assert skipped == [mirror.url_of(20)]


def test_a_tie_goes_to_the_run_directory(tmp_path):
    run, local = tmp_path / "run", tmp_path / "shm"
    fake_checkpoint(run, 10)
    fake_checkpoint(local, 10)
    found, _ = Tiers(output(local_save_steps=2, local_save_dir=str(local)), run, 0, print).newest()
    assert found.tier == RUN_TIER


def test_upload_then_download_gives_the_same_files_with_complete_last(tmp_path, mirror_url):
    source = fake_checkpoint(tmp_path / "a", 6)
    mirror = Mirror(mirror_url)
    written = []
    real_put, real_pipe = mirror.fs.put_file, mirror.fs.pipe_file
    mirror.fs.put_file = lambda lpath, rpath, **kw: (written.append(rpath), real_put(lpath, rpath))
    mirror.fs.pipe_file = lambda path, data, **kw: (written.append(path), real_pipe(path, data))
    mirror.upload(source)
    assert [path.rsplit("/", 1)[1] for path in written] == [
        "shard.bin",
        "trainer_state.json",
        COMPLETE,
    ]
    assert mirror.steps() == ([6], [])

    run = tmp_path / "b"
    folder = mirror.download(6, run)
    assert folder == checkpoint_dir(run, 6)
    for name in ("trainer_state.json", "dcp/shard.bin", COMPLETE):
        assert (folder / name).read_bytes() == (source / name).read_bytes()
    assert not any(p.name.endswith((".download", ".part")) for p in run.rglob("*"))


def test_a_torn_mirror_copy_is_refused_by_url(tmp_path, mirror_url):
    mirror = Mirror(mirror_url)
    mirror.upload(fake_checkpoint(tmp_path / "a", 4))
    mirror.upload(fake_checkpoint(tmp_path / "a", 8))
    mirror.fs.rm_file(f"{mirror.remote(8)}/{COMPLETE}")
    with pytest.raises(
        CheckpointError, match="step-8 is incomplete.*newest complete one there is step-4"
    ):
        fetch_url(mirror.url_of(8), None, tmp_path / "run")
    assert fetch_url(mirror.url_of(4), None, tmp_path / "run") == checkpoint_dir(
        tmp_path / "run", 4
    )


def test_background_mirror_copies_prunes_and_survives_a_failure(tmp_path, mirror_url):
    run, messages = tmp_path / "run", []
    mirror = Mirror(mirror_url)
    uploader = BackgroundMirror(mirror, run, keep=2, log=messages.append)
    real_put, broken = mirror.fs.put_file, {"on": True}

    def flaky_put(lpath, rpath, **kw):
        if broken["on"]:
            raise ConnectionError("endpoint unreachable")
        return real_put(lpath, rpath)

    mirror.fs.put_file = flaky_put
    fake_checkpoint(run, 2)
    uploader.notify()
    deadline = time.monotonic() + 30
    while not messages and time.monotonic() < deadline:  # the thread's first copy failed
        time.sleep(0.01)
    fake_checkpoint(run, 4)
    broken["on"] = False  # the next checkpoint's sync copies both
    uploader.notify()
    fake_checkpoint(run, 6)
    uploader.finish(checkpoint_dir(run, 6))
    warnings = [m for m in messages if m.startswith("warning")]
    assert len(warnings) == 1 and "ConnectionError: endpoint unreachable" in warnings[0]
    assert "trying again after the next checkpoint" in warnings[0]
    assert mirror.steps() == ([4, 6], [])  # --save_total_limit 2 on the mirror too


def test_finish_waits_for_a_background_save_to_complete(tmp_path, mirror_url):
    import threading

    run = tmp_path / "run"
    folder = fake_checkpoint(run, 3, complete=False)
    mirror = Mirror(mirror_url)
    uploader = BackgroundMirror(mirror, run, keep=None, log=print)
    threading.Timer(0.3, lambda: (folder / COMPLETE).write_text("step 3\n")).start()
    uploader.finish(folder)
    assert mirror.steps() == ([3], [])


@pytest.mark.bad_input(
    input="A --checkpoint_mirror URL that cannot be written (no such bucket, a file, no access)",
    outcome="A config error before training starts, naming the URL, the reason and the "
    "settings to check (bucket, credentials, endpoint)",
)
def test_an_unwritable_mirror_is_a_config_error_at_startup(tmp_path):
    (tmp_path / "file").write_text("x")
    url = f"file://{tmp_path}/file/mirror"
    with pytest.raises(ConfigError, match="cannot be written.*endpoint"):
        Tiers(output(checkpoint_mirror=url), tmp_path / "run", 0, print)


def test_a_new_run_refuses_a_mirror_that_holds_another_runs_checkpoints(tmp_path, mirror_url):
    Mirror(mirror_url).upload(fake_checkpoint(tmp_path / "old", 5))
    tiers = Tiers(output(checkpoint_mirror=mirror_url), tmp_path / "run", 0, print)
    with pytest.raises(ConfigError, match="holds checkpoints of a run.*--resume_from_checkpoint"):
        tiers.start_fresh(0)


def test_a_fresh_start_drops_the_local_tier_of_an_earlier_run(tmp_path):
    local = tmp_path / "shm"
    fake_checkpoint(local, 40)
    tiers = Tiers(output(local_save_steps=2, local_save_dir=str(local)), tmp_path / "r", 0, print)
    tiers.start_fresh(0)
    assert not checkpoint_dir(local, 40).exists()


def test_the_default_local_dir_is_per_run_directory(tmp_path):
    a = default_local_dir(tmp_path / "x" / "run", shm=tmp_path)
    b = default_local_dir(tmp_path / "y" / "run", shm=tmp_path)
    assert a.parent == tmp_path / "swiftlm" and a.name.startswith("run-") and a != b
    with pytest.raises(ConfigError, match="pass --local_save_dir DIR"):
        default_local_dir(tmp_path / "run", shm=tmp_path / "missing")


def train(*flags) -> TrainConfig:
    return parse_config(TrainConfig, ["--dataset", "d.jsonl", *map(str, flags)], "swiftlm sft")


@pytest.mark.bad_input(
    input="Checkpoint tier flags that cannot work together (--local_save_dir alone, a "
    "--local_save_steps multiple of --save_steps, the local tier on several nodes, mirror "
    "options without a mirror, options that are not a JSON object)",
    outcome="A config error naming the flags and the fix, before anything loads",
)
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--local_save_dir", "/tmp/x"], "only used with --local_save_steps"),
        (["--local_save_steps", "20", "--save_steps", "10"], "is a multiple of --save_steps 10"),
        (["--local_save_steps", "2", "--nnodes", "2"], "one node only"),
        (["--checkpoint_mirror_options", "{}"], "only used with --checkpoint_mirror"),
    ],
)
def test_tier_flags_that_do_not_combine(flags, message):
    assert any(message in text for _, text in failures(train(*flags)))


def test_bad_mirror_flag_values():
    with pytest.raises(ConfigError, match="JSON object"):
        train("--checkpoint_mirror", "s3://b/p", "--checkpoint_mirror_options", "[1]")
    with pytest.raises(ConfigError, match="with its scheme"):
        train("--checkpoint_mirror", "bucket/prefix")
    assert not failures(train("--local_save_steps", "3", "--save_steps", "10"))


def block_checkpoint(root: Path, step: int, tensors: dict) -> Path:
    from swiftlm.checkpoint import blocks

    folder = checkpoint_dir(root, step)
    folder.mkdir(parents=True)
    blocks.write_block_checkpoint(folder, {"model": tensors})
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}))
    (folder / COMPLETE).write_text(f"step {step}\n")
    return folder


def test_block_checkpoints_mirror_their_blocks_once_and_prune_unused_ones(tmp_path, mirror_url):
    import torch

    from swiftlm.checkpoint import blocks

    frozen = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB: a block of its own
    run = tmp_path / "run"
    block_checkpoint(run, 2, {"frozen": frozen, "w": torch.ones(8)})
    block_checkpoint(run, 4, {"frozen": frozen, "w": torch.full((8,), 2.0)})
    mirror, uploaded = Mirror(mirror_url), []
    real_put = mirror.fs.put_file
    mirror.fs.put_file = lambda lpath, rpath, **kw: (uploaded.append(rpath), real_put(lpath, rpath))
    mirror.upload(checkpoint_dir(run, 2))
    first = [p for p in uploaded if "/blocks/" in p]
    uploaded.clear()
    mirror.upload(checkpoint_dir(run, 4))
    second = [p for p in uploaded if "/blocks/" in p]
    assert len(first) == 2 and len(second) == 1  # the frozen tensor's block is there already

    elsewhere = tmp_path / "elsewhere"
    folder = mirror.download(4, elsewhere)
    restored = blocks.read_group(folder, "model")
    assert torch.equal(restored["frozen"], frozen) and torch.equal(
        restored["w"], torch.full((8,), 2.0)
    )

    assert mirror.prune(keep=1) == [2]
    left = {p.rsplit("/", 1)[1] for p in mirror.fs.find(f"{mirror.root}/checkpoints/blocks")}
    assert left == {f"{d}.bin" for d in blocks.referenced_blocks(checkpoint_dir(run, 4))}
