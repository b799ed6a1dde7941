"""Loading plugins: `--external_plugins` files and installed entry points, found before the
flags are parsed (on the command line or in the YAML file); each kind of broken plugin is an
error that names it (file and line, or entry point and distribution), exit code 2."""

import sys
import textwrap

import pytest

from plugin_isolation import isolated_plugins  # noqa: F401 (a fixture)
from swiftlm.cli.main import main
from swiftlm.plugins import load_plugins, loaded_plugins
from swiftlm.plugins.loading import plugin_files

pytestmark = pytest.mark.usefixtures("isolated_plugins")

GOOD = """
import swiftlm.plugins as plugins

def shout(completions, **kwargs):
    return [float(text.isupper()) for text in completions]

plugins.register_reward("shout", shout)
"""


def plugin(tmp_path, text: str, name: str = "plugin.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def grpo_help(*files) -> list[str]:
    # --help exits after parsing: the plugins are loaded, no model is.
    flags = [
        "--rlhf_type",
        "grpo",
        "--reward_funcs",
        "shout",
        "--external_plugins",
        *map(str, files),
    ]
    return ["rlhf", *flags, "--help"]


def error_of(capsys, argv) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_a_file_plugin_is_loaded_once_and_extends_the_flags_choices(tmp_path, capsys):
    path = plugin(tmp_path, GOOD)
    with pytest.raises(SystemExit) as done:
        main(grpo_help(path, path))
    assert done.value.code == 0
    err = capsys.readouterr().err
    assert err.count(f"swiftlm: loaded plugins: plugin file {path}") == 1
    assert loaded_plugins() == [f"plugin file {path}"]
    assert load_plugins([str(path)]) == []  # lazily, once per process
    from swiftlm.methods.rl.config import GRPOArguments
    from swiftlm.methods.rl.rewards import REWARD_FUNCS

    shout = REWARD_FUNCS["shout"](GRPOArguments())  # the builder gives the plugin's function
    assert shout(completions=["AB", "ab"]) == [1.0, 0.0]


def test_without_the_plugin_the_name_is_refused(capsys):
    err = error_of(capsys, ["rlhf", "--rlhf_type", "grpo", "--reward_funcs", "shout"])
    assert "--reward_funcs shout: not a built-in or plugin reward" in err


def test_plugin_files_come_from_flags_and_from_the_yaml_file(tmp_path):
    assert plugin_files(["--external_plugins", "a.py", "b.py", "--max_steps", "1"]) == [
        "a.py",
        "b.py",
    ]
    assert plugin_files(["--external-plugins=c.py", "--x", "1"]) == ["c.py"]
    flat = tmp_path / "flat.yaml"
    flat.write_text("external_plugins: [d.py]\n")
    nested = tmp_path / "nested.yaml"
    nested.write_text("plugins:\n  external_plugins:\n    - e.py\n")
    assert plugin_files([str(flat), "--external_plugins", "f.py"]) == ["d.py", "f.py"]
    assert plugin_files([str(nested)]) == ["e.py"]


BROKEN = {
    "missing": (None, "the file {path} does not exist"),
    "syntax": ("import os\ndef f(:\n", "plugin file {path}: syntax error at {path}:2"),
    "raises": (
        "x = 1\nraise RuntimeError('no licence key')\n",
        "plugin file {path}: importing it failed at {path}:2: RuntimeError: no licence key",
    ),
    "bad_signature": (
        "import swiftlm.plugins as p\ndef one(logits):\n    return logits.sum()\n"
        "p.register_loss('one', one)\n",
        "plugin file {path}: loss 'one' has the wrong signature (logits)",
    ),
    "reward_without_kwargs": (
        "import swiftlm.plugins as p\np.register_reward('r', lambda completions: [])\n",
        "plugin file {path}: reward 'r' has the signature (completions); it must accept **kwargs",
    ),
    "builtin_name": (
        "import swiftlm.plugins as p\np.register_reward('accuracy', lambda **kw: [])\n",
        "plugin file {path}: cannot register reward function 'accuracy': the name is already "
        "registered by swiftlm (built in); choose another name, or pass replace=True",
    ),
    "api_version": (
        "SWIFTLM_API_VERSION = '2.0'\n",
        "plugin file {path} needs the swiftlm plugin API 2.0, but this swiftlm provides 1.0",
    ),
    "register_raises": (
        "def register():\n    raise KeyError('config')\n",
        "plugin file {path}: register() failed at {path}:2: KeyError: 'config'",
    ),
}


@pytest.mark.bad_input(
    input="A broken `--external_plugins` file: missing, a syntax error, raising at import or in "
    "register(), a bad registration (signature, a taken name), a newer API version",
    outcome="Exit 2 before any model loads; the message names the file (and line) and the fault",
)
@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_a_broken_plugin_file_is_an_error_naming_it(kind, tmp_path, capsys):
    text, expected = BROKEN[kind]
    path = tmp_path / f"{kind}.py"
    if text is not None:
        path.write_text(text)
    err = error_of(capsys, ["sft", "--external_plugins", str(path), "--max_steps", "1"])
    assert expected.format(path=path) in err
    assert "Traceback" not in err


@pytest.mark.bad_input(
    input="Two plugins register the same name",
    outcome="Exit 2; the message names both plugins and the name; `replace=True` replaces",
)
def test_a_name_taken_by_another_plugin_names_both(tmp_path, capsys):
    first = plugin(tmp_path, GOOD, "first.py")
    second = plugin(tmp_path, GOOD, "second.py")
    err = error_of(capsys, grpo_help(first, second))
    assert (
        f"plugin file {second}: cannot register reward function 'shout': the name is already "
        f"registered by plugin file {first}"
    ) in err
    third = plugin(
        tmp_path, GOOD.replace('"shout", shout)', '"shout", shout, replace=True)'), "3.py"
    )
    load_plugins([str(third)])
    from swiftlm.plugins import registered_by

    assert registered_by("reward function", "shout") == f"plugin file {third}"


@pytest.mark.bad_input(
    input="An installed package whose `swiftlm.plugins` entry point fails to import",
    outcome="Exit 2; the message names the entry point, its distribution and version, file:line",
)
def test_a_broken_entry_point_names_it_and_its_distribution(tmp_path, monkeypatch, capsys):
    from swiftlm.plugins import loading

    (tmp_path / "acme_plugin.py").write_text("import json\nraise ImportError('needs acme-sdk')\n")
    info = tmp_path / "acme_plugin-2.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-plugin\nVersion: 2.1\n")
    (info / "entry_points.txt").write_text("[swiftlm.plugins]\nacme = acme_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(loading, "_entry_points_done", False)
    err = error_of(capsys, ["sft", "--max_steps", "1"])
    assert (
        "entry point 'acme' = acme_plugin (acme-plugin 2.1): importing it failed at "
        f"{tmp_path / 'acme_plugin.py'}:2: ImportError: needs acme-sdk"
    ) in err
    sys.modules.pop("acme_plugin", None)


@pytest.mark.bad_input(
    input="`--loss_type` or `--dataset_format` naming nothing a plugin registered",
    outcome="Exit 2; the message lists the registered names and says how to load a plugin",
)
def test_an_unregistered_loss_or_format_is_refused(tiny_model_dir, chat_jsonl, tmp_path, capsys):
    from conftest import tiny_sft

    argv = tiny_sft(tiny_model_dir, chat_jsonl, tmp_path / "run", max_steps=1)
    err = error_of(capsys, [*argv, "--loss_type", "focal"])
    assert "--loss_type focal: not a registered loss (no plugin registers one); load the" in err
    err = error_of(capsys, [*argv, "--dataset_format", "qa"])
    assert "--dataset_format qa: not a registered dataset format (none is registered)" in err
