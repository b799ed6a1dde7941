"""No output flag writes over what the user has (`config/outputs.py`), and a path of the wrong
kind is named (`config/paths.py`, the plugin loader): each case runs `swiftlm.cli.main.main`
in-process, and is refused before the command starts its work (nothing loads), with
the flag, the path and the way out; every file involved is left byte-identical."""

import hashlib
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import CHAT_ROWS, write_jsonl
from plugin_isolation import isolated_plugins  # noqa: F401 (a fixture)
from swiftlm.cli import main as cli
from swiftlm.config import UNUSED_FLAGS, parse_config
from swiftlm.config.outputs import OUTPUTS, check_outputs
from swiftlm.errors import ConfigError

# Some cases load the `--external_plugins` file in-process: its registrations end with the test.
pytestmark = pytest.mark.usefixtures("isolated_plugins")


@pytest.fixture
def inputs(tmp_path, monkeypatch) -> SimpleNamespace:
    """A dataset file, a dataset folder, a model folder, a finished run's folder and a plugin
    file, in the working directory (some cases name them relatively)."""
    monkeypatch.chdir(tmp_path)
    data_dir = tmp_path / "data_dir"
    data_dir.mkdir()
    write_jsonl(data_dir / "part.jsonl", CHAT_ROWS[:2])
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}\n')
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model:\n  model: model\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    plugin = tmp_path / "plugin.py"
    plugin.write_text("def register():\n    pass\n")
    return SimpleNamespace(
        root=tmp_path,
        data=write_jsonl(tmp_path / "rows.jsonl", CHAT_ROWS[:3]),
        data_dir=data_dir,
        model=model,
        run=run,
        plugin=plugin,
    )


@pytest.fixture(autouse=True)
def nothing_runs(monkeypatch):
    """Reaching the command's work (its libraries set up, or torchrun started) fails the
    test: the refusal must come first."""

    def started(*args, **kwargs):
        raise AssertionError("the command started its work before the refusal")

    monkeypatch.setattr(cli, "quiet_libraries", started)
    monkeypatch.setattr(cli, "launch", started)


def digest(path: Path) -> str:
    """The bytes of a file, or of every file below a folder (names included)."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    sha = hashlib.sha256()
    for file in files:
        sha.update(str(file.relative_to(path.parent)).encode() + b"\0" + file.read_bytes())
    return sha.hexdigest()


def refused(capsys, argv: list[str], *fragments: str) -> str:
    """Run the CLI, expect a usage error (exit 2) whose message holds `fragments`."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, err
    return err


# (command, output flag, the command's other flags, the input the output is pointed at,
# an existing output: "file" writes a file there, "folder" a folder holding NAME).
OUTPUT_FLAGS = {
    "infer --result_path": (
        "infer",
        "--result_path",
        ["--model", "{model}", "--val_dataset", "{data}"],
        "{data}",
        "file",
    ),
    "eval --eval_output_dir": (
        "eval",
        "--eval_output_dir",
        ["--model", "{model}", "--eval_dataset", "{data}"],
        "{model}",
        "folder:summary.json",
    ),
    "export --output_dir": (
        "export",
        "--output_dir",
        ["--model", "{model}", "--merge_lora", "true"],
        "{model}",
        "folder:model.safetensors",
    ),
    "report --output": ("report", "--output", ["{run}"], "{run}/metrics.jsonl", "file"),
    "plan --output_json": (
        "plan",
        "--output_json",
        ["--model", "{model}"],
        "{model}/config.json",
        "file",
    ),
    # Reused folders: an existing run directory is `train/rundir.py`'s (tests/integration/
    # test_run_dirs.py); here a file where the folder goes, and an input as the folder.
    "sft --output_dir": (
        "sft",
        "--output_dir",
        ["--model", "{model}", "--dataset", "{data_dir}"],
        "{data_dir}",
        "file",
    ),
    "sft --local_save_dir": (
        "sft",
        "--local_save_dir",
        ["--model", "{model}", "--dataset", "{data}", "--local_save_steps", "1"],
        "{model}",
        "file",
    ),
    "web --runs_dir": ("web", "--runs_dir", ["--external_plugins", "{plugin}"], "{plugin}", "file"),
}


def filled(values: list[str], inputs) -> list[str]:
    return [value.format(**vars(inputs)) for value in values]


def existing_output(inputs, existing: str) -> tuple[Path, Path]:
    """(the output path, the file already there)."""
    if existing == "file":
        target = inputs.root / "earlier.out"
        target.write_text("an earlier result the user keeps\n")
        return target, target
    target = inputs.root / "earlier"
    target.mkdir()
    file = target / existing.split(":")[1]
    file.write_text("an earlier result the user keeps\n")
    return target, file


def test_every_output_flag_is_covered():
    declared = {f"{cls.__name__}:{o.flag}" for cls, outputs in OUTPUTS.items() for o in outputs}
    commands = {"infer": "Infer", "eval": "Eval", "export": "Export", "report": "Report"}
    commands |= {"plan": "Plan", "sft": "Train", "web": "Web"}
    covered = {f"{commands[c]}Config:{flag[2:]}" for c, flag, *_ in OUTPUT_FLAGS.values()}
    assert covered == declared


@pytest.mark.bad_input(
    input="An output flag (--result_path, --eval_output_dir, export --output_dir, report "
    "--output, plan --output_json) naming an existing file or a folder holding an earlier "
    "output; for training's --output_dir, --local_save_dir and web's --runs_dir, a file",
    outcome="Refused before anything loads, naming the flag, the path, and --overwrite_output_dir "
    "true (or a new path); the file is left byte-identical",
)
@pytest.mark.parametrize("case", list(OUTPUT_FLAGS))
def test_an_existing_output_is_refused_and_kept(case, inputs, capsys):
    command, flag, argv, _, existing = OUTPUT_FLAGS[case]
    target, file = existing_output(inputs, existing)
    before = digest(file)
    reused = command in ("sft", "web")
    fix = "is a file; pass a folder" if reused else "--overwrite_output_dir true"
    refused(capsys, [command, *filled(argv, inputs), flag, str(target)], flag, str(target), fix)
    assert digest(file) == before


@pytest.mark.bad_input(
    input="An output flag naming one of the run's inputs: `swiftlm infer --val_dataset rows.jsonl "
    "--result_path rows.jsonl`, the model folder as --output_dir / --eval_output_dir, a file of "
    "an input run (report --output RUN/metrics.jsonl), the dataset folder as sft --output_dir",
    outcome="Refused before anything loads, also with --overwrite_output_dir true, naming the "
    "output flag, the input flag and a path of its own; the input is left byte-identical",
)
@pytest.mark.parametrize("case", list(OUTPUT_FLAGS))
def test_an_input_as_output_is_refused_and_kept(case, inputs, capsys):
    command, flag, argv, input_path, _ = OUTPUT_FLAGS[case]
    target = Path(filled([input_path], inputs)[0])
    before = digest(target)
    argv = [command, *filled(argv, inputs), flag, str(target)]
    has_overwrite = command not in ("sft", "web")  # theirs are training's / none
    refused(capsys, argv, flag, str(target))
    if has_overwrite:
        refused(capsys, [*argv, "--overwrite_output_dir", "true"], "an input of this run")
    assert digest(target) == before


def check(command: str, *argv: str) -> None:
    """The shared output check on a command's parsed flags, as `main` runs it."""
    config_cls = cli.COMMANDS[command][0]
    import swiftlm.config as config_module

    cls = getattr(config_module, config_cls)
    check_outputs(parse_config(cls, list(argv), f"swiftlm {command}", unused=UNUSED_FLAGS[command]))


def test_overwrite_output_dir_lets_an_existing_output_be_replaced(inputs):
    earlier = inputs.root / "earlier.jsonl"
    earlier.write_text("{}\n")
    ok = ["--overwrite_output_dir", "true"]
    check("infer", "--val_dataset", str(inputs.data), "--result_path", str(earlier), *ok)
    check("plan", "--output_json", str(earlier), *ok)
    check("report", "--run_dirs", str(inputs.run), "--output", str(earlier), *ok)
    folder = inputs.root / "eval-out"
    folder.mkdir()
    (folder / "summary.json").write_text("{}\n")
    check("eval", "--eval_dataset", str(inputs.data), "--eval_output_dir", str(folder), *ok)
    check("export", "--model", str(inputs.model), "--output_dir", str(folder), *ok)
    # Without it, --compare writes compare.json only: an earlier evaluation's files stay.
    check("eval", "--compare", "a", "b", "--eval_output_dir", str(folder))


@pytest.mark.bad_input(
    input="An output reaching an input another way: a symlink to the dataset, a relative "
    "path (`./x/../rows.jsonl`), a hard link, a folder holding the dataset or model "
    "(--eval_output_dir .), a file inside a --val_dataset/--dataset folder",
    outcome="Refused like the input itself (both sides resolved), naming the input; a folder "
    "read whole is named as such",
)
def test_links_relative_paths_and_enclosing_folders_are_the_input(inputs):
    link = inputs.root / "link.jsonl"
    link.symlink_to(inputs.data)
    hard = inputs.root / "hard.jsonl"
    hard.hardlink_to(inputs.data)
    (inputs.root / "x").mkdir()
    for result in (link, hard, "./x/../rows.jsonl"):
        with pytest.raises(ConfigError, match="is --val_dataset rows.jsonl, an input"):
            check("infer", "--val_dataset", "rows.jsonl", "--result_path", str(result))
    with pytest.raises(ConfigError, match=r"--eval_output_dir \. holds --model model"):
        check("eval", "--model", "model", "--eval_dataset", "x.jsonl", "--eval_output_dir", ".")
    with pytest.raises(ConfigError, match=r"--output_dir \. holds --dataset rows.jsonl"):
        check("export", "--dataset", "rows.jsonl", "--output_dir", ".")
    with pytest.raises(ConfigError, match="inside --val_dataset data_dir, a folder read whole"):
        check("infer", "--val_dataset", "data_dir", "--result_path", "data_dir/new.jsonl")
    with pytest.raises(ConfigError, match="inside --dataset data_dir, a folder read whole"):
        check("sft", "--dataset", "data_dir", "--output_dir", "data_dir/run")


def test_a_run_directory_input_keeps_its_files_but_takes_new_ones(inputs):
    with pytest.raises(ConfigError, match="is a file of --ckpt_dir"):
        check("infer", "--ckpt_dir", "run", "--val_dataset", "rows.jsonl", "--result_path",
              "run/config.yaml", "--overwrite_output_dir", "true")  # fmt: skip
    check(
        "infer", "--ckpt_dir", "run", "--val_dataset", "rows.jsonl", "--result_path", "run/a.jsonl"
    )
    # The report's own page inside the run it draws is an output, replaced when asked to.
    (inputs.run / "report.html").write_text("<html></html>")
    with pytest.raises(ConfigError, match="--overwrite_output_dir true"):
        check("report", "--run_dirs", "run", "--output", "run/report.html")
    check("report", "--run_dirs", "run", "--output", "run", "--overwrite_output_dir", "true")


def test_reused_folders_keep_their_semantics(inputs):
    """A training run continues in its folder, and a new version goes below it: neither the
    earlier run nor an input inside it is a reason to refuse here (train/rundir.py decides)."""
    check(
        "sft", "--dataset", "rows.jsonl", "--output_dir", "run", "--resume_from_checkpoint", "auto"
    )
    check("sft", "--dataset", "run/metrics.jsonl", "--output_dir", ".", "--add_version", "true")
    # A new version of a run, fine-tuned from the run's final model, goes into run/v0-...
    (inputs.run / "final").mkdir()
    check("sft", "--model", "run/final", "--output_dir", "run", "--add_version", "true")
    check("web", "--runs_dir", "run")
    with pytest.raises(ConfigError, match="writes .*run/metrics.jsonl, which is --dataset"):
        check("sft", "--dataset", "run/metrics.jsonl", "--output_dir", "run")


# ---- a path of the wrong kind -------------------------------------------------------------------


@pytest.mark.bad_input(
    input="A path flag given the wrong kind of path: `--external_plugins notes.txt` or a folder, "
    "`--deepspeed` a folder or a .yaml file, `--images` a folder, `plan --output_json` a "
    "folder, `web --runs_dir` a file",
    outcome="Error naming the flag, the path, what it is and what to pass; no traceback, nothing "
    "loads",
)
def test_a_path_of_the_wrong_kind_is_named(inputs, capsys):
    notes = inputs.root / "notes.txt"
    notes.write_text("not python\n")
    refused(capsys, ["sft", "--external_plugins", str(notes)], "is a .txt file, not .py")
    refused(
        capsys, ["infer", "--external_plugins", str(inputs.data_dir)], "is a folder; pass a Python"
    )
    refused(capsys, ["sft", "--deepspeed", str(inputs.data_dir)], "--deepspeed", "is a folder")
    yaml_file = inputs.root / "ds.yaml"
    yaml_file.write_text("zero_optimization: {}\n")
    refused(capsys, ["sft", "--deepspeed", str(yaml_file)], "is a .yaml file, not .json")
    refused(capsys, ["infer", "--images", str(inputs.data_dir)], "--images", "is a folder")
    refused(capsys, ["plan", "--output_json", str(inputs.data_dir)], "is a folder; pass a file")
    refused(capsys, ["web", "--runs_dir", str(inputs.data)], "is a file; pass a folder")
