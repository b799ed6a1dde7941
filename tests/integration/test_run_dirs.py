"""Run directories are never mixed, and every path is checked before anything loads.

A new run refuses an --output_dir that holds files and says how to continue, replace or
version it; a resume compares the saved config.yaml with this run's first; a path that is not
what its flag needs is named as what it is. Each error comes before the model is found or
loaded: `forbid_loading` fails the test otherwise.
"""

import json
import math
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import CHAT_ROWS, logged, tiny_sft, write_jsonl
from swiftlm.cli.main import main
from swiftlm.train import rundir

# A 4-step cosine LoRA run without warmup, a checkpoint every 2 steps.
STEPS = dict(max_steps=4, save_steps=2, learning_rate=1e-2, lora_dropout=0)


def forbid_loading(monkeypatch) -> None:
    """Finding or loading a model or tokenizer fails the test: the error must come first."""

    def loaded(*args, **kwargs):
        raise AssertionError("a model was found or loaded before the error")

    for target in (
        "swiftlm.train.run.resolve_model",
        "swiftlm.train.prepare.load_tokenizer",
        "swiftlm.train.prepare.load_model",
        "swiftlm.infer.run.build_chat_engine",
        "swiftlm.checkpoint.resolve.resolve_model",
        "swiftlm.export.merge.merge_lora",
    ):
        monkeypatch.setattr(target, loaded)


@pytest.fixture(scope="module")
def finished(tiny_model_dir, tmp_path_factory):
    """A finished run (`run`: checkpoints step-2 and step-4, final/) and its data (`data`)."""
    root = tmp_path_factory.mktemp("finished")
    data = write_jsonl(root / "chat.jsonl", CHAT_ROWS)
    run = root / "run"
    assert main(tiny_sft(tiny_model_dir, data, run, **STEPS)) == 0
    return SimpleNamespace(run=run, data=data, model=tiny_model_dir)


def copy_of(finished, tmp_path: Path) -> Path:
    """A copy of the finished run that a test may change."""
    return Path(shutil.copytree(finished.run, tmp_path / "run"))


def sft(finished, out: Path, **flags) -> int:
    return main(tiny_sft(finished.model, finished.data, out, **flags))


def tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ---- a new run in a used folder ----------------------------------------------------------------


@pytest.mark.bad_input(
    input="A new run in an --output_dir that holds an earlier run",
    outcome="Refused before anything loads, naming --resume_from_checkpoint auto, a new "
    "--output_dir, --overwrite_output_dir true and --add_version true",
)
def test_a_new_run_in_a_used_run_directory_is_refused(finished, monkeypatch, capsys):
    before = tree(finished.run)
    forbid_loading(monkeypatch)
    assert sft(finished, finished.run, max_steps=2) == 2
    err = capsys.readouterr().err
    assert f"swiftlm sft: error: --output_dir {finished.run} holds an earlier run" in err
    choices = (
        "--resume_from_checkpoint auto to continue it",
        "a new --output_dir",
        "--overwrite_output_dir true to delete it and start over",
        f"--add_version true to write this run into a fresh subfolder {finished.run}/v<N>-",
    )
    for choice in choices:
        assert choice in err
    assert tree(finished.run) == before


@pytest.mark.bad_input(
    input="A new run in a non-empty --output_dir that is not a swiftlm run directory",
    outcome="Refused, naming a new --output_dir and --add_version true; "
    "--overwrite_output_dir refuses to delete it",
)
def test_a_folder_of_other_files_is_refused_and_never_deleted(
    finished, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    forbid_loading(monkeypatch)
    assert sft(finished, out) == 2
    err = capsys.readouterr().err
    assert f"--output_dir {out} is not empty (notes.txt) and is not a swiftlm run directory" in err
    assert "choose a new or empty --output_dir, or --add_version true" in err
    assert sft(finished, out, overwrite_output_dir="true") == 2
    err = capsys.readouterr().err
    assert f"--overwrite_output_dir true: {out} is not a swiftlm run directory" in err
    assert "refusing to delete it" in err
    assert (out / "notes.txt").read_text() == "keep me"


def test_overwrite_output_dir_deletes_the_earlier_run_first(finished, tmp_path, capsys):
    run = copy_of(finished, tmp_path)
    flags = dict(max_steps=3, save_steps=100, overwrite_output_dir="true")
    assert sft(finished, run, **flags) == 0
    printed = capsys.readouterr().out
    assert f"--overwrite_output_dir: deleted the earlier run in {run} (checkpoints/, " in printed
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-3"]
    assert logged(run, "step")[:3] == [1, 2, 3] and len(logged(run, "loss")) == 3
    # A rerun of the saved config.yaml never deletes anything.
    assert "overwrite_output_dir: false" in (run / "config.yaml").read_text()


@pytest.mark.bad_input(
    input="--overwrite_output_dir on a run directory that holds an input (--dataset, --model) "
    "or another run (an --add_version subfolder)",
    outcome="Refused before anything is deleted, naming the input or the run",
)
def test_overwrite_never_deletes_an_input(finished, tmp_path, monkeypatch, capsys):
    run = copy_of(finished, tmp_path)
    data = Path(shutil.copy(finished.data, run / "chat.jsonl"))
    forbid_loading(monkeypatch)
    argv = tiny_sft(finished.model, data, run, overwrite_output_dir="true")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--overwrite_output_dir true would delete --dataset {data}" in err
    assert data.is_file() and (run / "final").is_dir()
    data.unlink()
    nested = Path(shutil.copytree(finished.run, run / "v0-20250101-120000"))  # --add_version's
    assert sft(finished, run, overwrite_output_dir="true") == 2
    err = capsys.readouterr().err
    assert f"--overwrite_output_dir true would delete the run {nested}" in err
    assert (nested / "final").is_dir() and (run / "final").is_dir()


def test_add_version_writes_each_run_into_a_fresh_subfolder(finished, tmp_path, capsys):
    base = tmp_path / "runs"
    for _ in range(2):
        assert sft(finished, base, max_steps=1, add_version="true") == 0
    versions = sorted(p.name for p in base.iterdir())
    assert [v.split("-")[0] for v in versions] == ["v0", "v1"]
    assert all(re.fullmatch(r"v\d+-\d{8}-\d{6}", v) for v in versions), versions
    assert all((base / v / "final").is_dir() and len(logged(base / v)) == 1 for v in versions)
    assert f"--add_version: this run writes to {base / versions[1]}" in capsys.readouterr().out
    saved = (base / versions[1] / "config.yaml").read_text()
    assert f"output_dir: {base / versions[1]}" in saved and "add_version: false" in saved


# ---- paths checked before anything loads -------------------------------------------------------


@pytest.mark.bad_input(
    input="--output_dir that is a file (or inside one)",
    outcome="Refused before anything loads, naming the file",
)
@pytest.mark.parametrize("below", [False, True], ids=["the-file", "inside-it"])
def test_output_dir_that_is_a_file(finished, tmp_path, monkeypatch, capsys, below):
    file = tmp_path / "afile"
    file.write_text("x")
    out = file / "run" if below else file
    forbid_loading(monkeypatch)
    assert sft(finished, out) == 2
    err = capsys.readouterr().err
    assert f"--output_dir {out}: {file} is a file; pass a folder" in err
    assert file.read_text() == "x"


@pytest.mark.bad_input(
    input="--dataset or --val_dataset naming a local file that does not exist",
    outcome="Refused before anything loads, naming the flag and the path",
)
@pytest.mark.parametrize("flag", ["dataset", "val_dataset"])
def test_a_missing_dataset_file_fails_before_anything_loads(
    finished, tmp_path, monkeypatch, capsys, flag
):
    missing = tmp_path / "chat.jsonl"
    argv = tiny_sft(finished.model, finished.data, tmp_path / "out")
    if flag == "dataset":
        argv[argv.index("--dataset") + 1] = str(missing)
    else:
        argv += ["--val_dataset", f"{missing}#5"]
    forbid_loading(monkeypatch)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"--{flag} {missing}: no such file or folder" in err
    assert not (tmp_path / "out").exists()


def _resume_target(kind: str, finished, tmp_path: Path) -> tuple[Path, str]:
    """(a --resume_from_checkpoint value of this kind, the start of its error message)."""
    run, flag = finished.run, "--resume_from_checkpoint"
    if kind == "missing":
        target = tmp_path / "no-such-checkpoint"
        return target, f"{flag} {target}: no such folder"
    if kind == "file":
        target = tmp_path / "checkpoint.txt"
        target.write_text("x")
        return target, f"{flag} {target} is a file, not a checkpoint folder"
    if kind == "empty":
        target = tmp_path / "empty"
        target.mkdir()
        return target, f"{flag} {target} is an empty folder, not a checkpoint"
    newest = run / "checkpoints" / "step-4"
    if kind == "run":
        return run, (
            f"{flag} {run} is a run directory, not a checkpoint: resume from its newest complete "
            f"checkpoint with {flag} {newest}, or with {flag} auto --output_dir {run}"
        )
    if kind == "checkpoints":
        return run / "checkpoints", (
            f"{flag} {run / 'checkpoints'} is the checkpoints/ folder of the run {run}, not a "
            f"checkpoint: pass one of them, e.g. the newest complete one: {flag} {newest}"
        )
    if kind == "final":
        final = run / "final"
        return final, (
            f"{flag} {final} holds final weights only (no optimizer state, schedule or data "
            f"position), so no run can resume from it; it is a LoRA adapter: load it with "
            f"--adapters {final} (swiftlm infer or export)"
        )
    copy = copy_of(finished, tmp_path)
    (copy / "checkpoints" / "step-4" / "COMPLETE").unlink()  # as if killed while saving
    target = copy / "checkpoints" / "step-4"
    return target, (
        f"{flag} {target} is incomplete (no COMPLETE marker: the run stopped while saving it); "
        "resume from an earlier checkpoint or use --resume_from_checkpoint auto"
    )


@pytest.mark.bad_input(
    input="--resume_from_checkpoint that is not a checkpoint: a missing path, a file, an empty "
    "folder, a run directory, its checkpoints/ or final/ folder, an incomplete checkpoint",
    outcome="Refused before anything loads, saying what it is and what to pass instead (a run "
    "directory: its newest checkpoint, or auto with --output_dir)",
)
@pytest.mark.parametrize(
    "kind", ["missing", "file", "empty", "run", "checkpoints", "final", "incomplete"]
)
def test_a_resume_target_that_is_not_a_checkpoint_is_named(
    finished, tmp_path, monkeypatch, capsys, kind
):
    target, message = _resume_target(kind, finished, tmp_path)
    forbid_loading(monkeypatch)
    assert sft(finished, tmp_path / "new", resume_from_checkpoint=target) == 1  # CheckpointError
    assert f"swiftlm sft: error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


# ---- resuming: the saved configuration ---------------------------------------------------------


@pytest.mark.bad_input(
    input="--resume_from_checkpoint with flags that differ from the saved run's (model, tuner "
    "shape, data, max_length, batching, seed, optimizer)",
    outcome="Refused before anything loads, listing each --flag with its saved and current "
    "value, and the fix",
)
def test_resume_names_each_difference_from_the_saved_config(finished, monkeypatch, capsys):
    before = tree(finished.run)
    forbid_loading(monkeypatch)
    changed = dict(STEPS, lora_rank=16, max_length=64, learning_rate=2e-2, seed=7)
    assert sft(finished, finished.run, **changed, resume_from_checkpoint="auto") == 2
    err = capsys.readouterr().err
    newest = finished.run / "checkpoints" / "step-4"
    assert f"--resume_from_checkpoint auto: {newest} was saved by a run with other settings" in err
    for line in (
        "--lora_rank: saved 8, now 16",
        "--max_length: saved 2048, now 64",
        "--seed: saved 42, now 7",
        "--learning_rate: saved 0.01, now 0.02",
    ):
        assert line in err
    assert (
        f"rerun with the saved values (in {finished.run / 'config.yaml'}), or start a new run "
        "in a new --output_dir"
    ) in err
    assert tree(finished.run) == before


def test_resume_with_more_steps_continues_on_a_rebuilt_schedule(finished, tmp_path, capsys):
    run = copy_of(finished, tmp_path)
    assert sft(finished, run, **dict(STEPS, max_steps=8), resume_from_checkpoint="auto") == 0
    printed = capsys.readouterr().out
    assert (
        "resuming with --max_steps 8 (the checkpoint was saved by a run with --max_steps 4)"
    ) in printed
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    lr = {row["step"]: row["learning_rate"] for row in rows if "learning_rate" in row}
    assert sorted(lr) == [1, 2, 3, 4, 5, 6, 7, 8]

    def cosine(step: int, total: int) -> float:
        return 1e-2 * 0.5 * (1 + math.cos(math.pi * step / total))

    # Steps 1-4 ran on the 4-step schedule; from step 5 on, the learning rate is the 8-step
    # schedule's (the checkpoint held the 4-step schedule's last value, 0).
    assert lr[4] == pytest.approx(cosine(3, 4))
    assert [lr[s] for s in (5, 6, 7, 8)] == pytest.approx([cosine(s - 1, 8) for s in (5, 6, 7, 8)])
    assert "learning rate follows this run's schedule from step 4: 0.005 (the checkpoint's " in (
        printed
    )


@pytest.mark.bad_input(
    input="--resume_from_checkpoint with --max_steps below the checkpoint's step",
    outcome="Refused before anything loads: names the checkpoint's step",
)
def test_resume_with_max_steps_below_the_checkpoint_is_refused(finished, monkeypatch, capsys):
    forbid_loading(monkeypatch)
    flags = dict(STEPS, max_steps=3, resume_from_checkpoint="auto")
    assert sft(finished, finished.run, **flags) == 2
    newest = finished.run / "checkpoints" / "step-4"
    assert f"--max_steps 3: the checkpoint {newest} is at step 4 already" in (
        capsys.readouterr().err
    )


def test_a_restarted_worker_resumes_its_run_and_never_clears_it(
    finished, tmp_path, monkeypatch, capsys
):
    run = copy_of(finished, tmp_path)
    (run / "checkpoints" / "step-4" / "COMPLETE").unlink()  # killed while saving step 4
    shutil.rmtree(run / "final")
    # As torchrun's --max_restarts sets it, in the launch whose first attempt started the run.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    (run / rundir.LAUNCH_MARK).write_text(rundir._this_launch())
    # The first attempt's command: a restart continues it, even with --overwrite_output_dir.
    assert sft(finished, run, **STEPS, overwrite_output_dir="true") == 0
    printed = capsys.readouterr().out
    assert f"resumed from {run / 'checkpoints' / 'step-2'} at step 2" in printed
    assert "deleted" not in printed
    assert (run / "final").is_dir() and logged(run, "step")[:2] == [1, 2]


# ---- infer and export: the model folders -------------------------------------------------------


@pytest.mark.bad_input(
    input="swiftlm infer/export --adapters naming a full model folder or a missing path; "
    "--ckpt_dir naming a file or a run's checkpoints/ folder",
    outcome="Refused before the model loads, saying what the path is and which flag loads it",
)
@pytest.mark.parametrize("command", ["infer", "export"])
@pytest.mark.parametrize("kind", ["full-as-adapter", "missing", "file", "checkpoints"])
def test_model_folder_flags_are_checked_before_loading(
    command, kind, tiny_model_dir, tiny_lora_run, tmp_path, monkeypatch, capsys
):
    file = tmp_path / "adapter.txt"
    file.write_text("x")
    checkpoints = tiny_lora_run / "checkpoints"
    flags, message = {
        "full-as-adapter": (
            ["--adapters", str(tiny_model_dir)],
            f"--adapters {tiny_model_dir} holds a full model (config.json), not an adapter "
            f"(adapter_config.json); load it with --model {tiny_model_dir}",
        ),
        "missing": (["--adapters", str(tmp_path / "nope")], f"--adapters {tmp_path / 'nope'}: "),
        "file": (
            ["--ckpt_dir", str(file)],
            f"--ckpt_dir {file} is a file; pass a swiftlm run directory, its final/ folder or a "
            "checkpoint folder",
        ),
        "checkpoints": (
            ["--ckpt_dir", str(checkpoints)],
            f"--ckpt_dir {checkpoints} is the checkpoints/ folder of the run {tiny_lora_run}: "
            f"pass the run itself (--ckpt_dir {tiny_lora_run}) or one checkpoint, e.g. "
            f"--ckpt_dir {checkpoints / 'step-6'}",
        ),
    }[kind]
    if command == "export":
        flags += ["--merge_lora", "true", "--output_dir", str(tmp_path / "out")]
    forbid_loading(monkeypatch)
    assert main([command, *flags]) != 0
    assert f"swiftlm {command}: error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.bad_input(
    input="swiftlm export --output_dir that is a file",
    outcome="Refused before anything loads, naming the file",
)
def test_export_output_dir_that_is_a_file(tiny_lora_run, tmp_path, monkeypatch, capsys):
    file = tmp_path / "out"
    file.write_text("x")
    forbid_loading(monkeypatch)
    argv = ["export", "--ckpt_dir", str(tiny_lora_run), "--merge_lora", "true"]
    assert main([*argv, "--output_dir", str(file)]) == 2
    assert f"--output_dir {file}: {file} is a file; pass a folder" in capsys.readouterr().err


@pytest.mark.bad_input(
    input="swiftlm infer --val_dataset or export --dataset naming a missing file; infer "
    "--result_path that is a folder",
    outcome="Refused before the model loads, naming the flag and the path",
)
@pytest.mark.parametrize("case", ["infer-prompts", "infer-result", "export-calibration"])
def test_infer_and_export_check_their_data_paths_first(
    case, tiny_lora_run, tmp_path, monkeypatch, capsys
):
    missing, prompts = tmp_path / "prompts.jsonl", write_jsonl(tmp_path / "p.jsonl", CHAT_ROWS[:1])
    run = ["--ckpt_dir", str(tiny_lora_run)]
    argv, message = {
        "infer-prompts": (
            ["infer", *run, "--val_dataset", str(missing)],
            f"--val_dataset {missing}: no such file or folder",
        ),
        "infer-result": (
            ["infer", *run, "--val_dataset", str(prompts), "--result_path", str(tmp_path)],
            f"--result_path {tmp_path} is a folder; pass a file path",
        ),
        "export-calibration": (
            ["export", *run, "--quant_method", "gptq", "--dataset", str(missing)],
            f"--dataset {missing}: no such file or folder",
        ),
    }[case]
    if argv[0] == "export":
        argv += ["--output_dir", str(tmp_path / "out")]
    forbid_loading(monkeypatch)
    assert main(argv) != 0
    assert f"swiftlm {argv[0]}: error: {message}" in capsys.readouterr().err
