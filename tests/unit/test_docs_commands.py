"""Every `swiftlm ...` command line in README.md and docs/ goes through the real command-line
entry (`swiftlm.cli.main.main`) up to the point where the command would start: its flags
exist for that command and their values parse. Nothing runs: the path checks, the torchrun
launch and the command's `run` are replaced for the test.

What counts as a command line: in fenced code blocks, every line (in blocks that show a
session, `$ ` lines only) whose command is `swiftlm` (or `.venv/bin/swiftlm`, `-m swiftlm`),
joined with its `\\` continuations, cut at `|`, `&&` and `;`, comments dropped. Output lines
(`swiftlm sft: error: ...`) are not commands, and neither are inline code spans in prose,
which name commands and flags (often a flag without its value). How the docs' shorthand
reads:

- `...` (more flags) is dropped;
- a placeholder, `<path>` or an all-capitals word (`RUN`, `N`), is a value of the flag it
  follows: `1` for an integer flag, `1.0` for a float, `true` for a boolean, the first choice
  of a flag with choices, a word otherwise; `swiftlm <command>` stands for every command;
- `a|b` inside a word is each alternative in turn (`swiftlm sft|pt ...`);
- a YAML file that does not exist here (`cfg.yaml`) is read as an empty one;
- `--external_plugins` files that do not exist here are not loaded; the plugin names the docs
  use (`demo_focal`, `brevity`, `my_parser`) come from the example package and a stub plugin;
- a `$ ` command whose shown output is `swiftlm <command>: error: ...` may fail, but then
  with the error the docs show.
"""

import dataclasses
import itertools
import re
import shlex
import types
import typing
from pathlib import Path

import pytest

from plugin_isolation import fresh_registries
from swiftlm.config.sections import flag_type

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDER = "PLACEHOLDER"
HELP = {"-h", "--help", "help"}
VERSION = {"-V", "--version"}
# Plugin names the docs use whose plugin is shown, not shipped (docs/plugins.md).
STUB_PLUGIN = """
import swiftlm.plugins as plugins

def brevity(completions, **kwargs):
    return [-len(text) / 100 for text in completions]

def my_parser(text):
    return text, []

def register():
    plugins.register_reward("brevity", brevity)
    plugins.register_tool_parser("my_parser", my_parser)
"""


@dataclasses.dataclass
class Line:
    where: str  # page:line
    text: str  # the command line as written (continuations joined)
    shown_error: str | None = None  # the `error:` output the docs show after it


def _strip_comment(line: str) -> str:
    """Cut an unquoted `#` that starts a word (bash's rule; `path#N` is not a comment)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _joined(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Join `\\` continuations: (first line number, whole line)."""
    out, buffer, start = [], "", None
    for number, text in lines:
        start = number if start is None else start
        if text.rstrip().endswith("\\"):
            buffer += text.rstrip()[:-1] + " "
            continue
        out.append((start, buffer + text))
        buffer, start = "", None
    if buffer:
        out.append((start, buffer))
    return out


def _block_lines(page: Path, language: str, body: list[tuple[int, str]]) -> list[Line]:
    name = page.relative_to(ROOT).as_posix()
    if language == "console" or any(text.startswith("$ ") for _, text in body):
        found: list[Line] = []
        command: list[tuple[int, str]] = []
        for number, text in body:
            if text.startswith("$ "):
                command = [(number, text[2:])]
                found.append(Line(f"{name}:{number}", text[2:]))
            elif command and command[-1][1].rstrip().endswith("\\"):
                command.append((number, text))
                found[-1].text = _joined(command)[0][1]
            elif found and found[-1].shown_error is None and ": error: " in text:
                found[-1].shown_error = text.split(": error: ", 1)[1].strip()
        return found
    if language not in ("", "bash", "sh", "shell"):
        return []
    return [Line(f"{name}:{n}", text) for n, text in _joined(body)]


def doc_lines(page: Path) -> list[Line]:
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Line] = []
    fence = None
    for number, text in enumerate(lines, 1):
        stripped = text.strip()
        if fence is None and stripped.startswith("```"):
            fence, language, body = stripped[:3], stripped[3:].strip(), []
        elif fence is not None and stripped.startswith(fence):
            found += _block_lines(page, language, body)
            fence = None
        elif fence is not None:
            body.append((number, text))
    return found


def _words(text: str) -> list[str]:
    text = re.sub(r"<[^<>\s]+>", PLACEHOLDER, _strip_comment(text))
    lexer = shlex.shlex(text, posix=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    return list(lexer)


def _alternatives(words: list[str]) -> list[list[str]]:
    """`sft|pt` inside a word: each alternative in turn (the product over such words)."""
    choices = [word.split("|") if re.search(r"\S\|\S", word) else [word] for word in words]
    return [list(combo) for combo in itertools.product(*choices)]


def swiftlm_argvs(line: Line) -> list[list[str]]:
    """The argument lists that `swiftlm` gets on this line (none when it is not a command)."""
    if not re.search(r"(^|[\s/])swiftlm(\s|$)", line.text):
        return []
    try:
        words = _words(line.text)
    except ValueError as exc:  # a quote left open: the line would not run either
        return [[f"(unreadable: {exc})"]]
    argvs = []
    segment: list[str] = []
    for word in [*words, ";"]:
        if word not in ("|", "||", "&&", ";"):
            segment.append(word)
            continue
        for i, w in enumerate(segment):
            if (w == "swiftlm" or w.endswith("/swiftlm")) and (i == 0 or segment[i - 1] == "-m"):
                rest = segment[i + 1 :]
                if not (rest and rest[0].endswith(":")):  # `swiftlm sft: error: ...` is output
                    argvs += _alternatives(rest)
                break
        segment = []
    return argvs


def _field_types(command: str) -> dict[str, type]:
    import swiftlm.config as config_module
    from swiftlm.cli.main import COMMANDS
    from swiftlm.config.parse import section_types

    config_cls = getattr(config_module, COMMANDS[command][0])
    return {
        f.name: flag_type(f)
        for cls in section_types(config_cls).values()
        for f in dataclasses.fields(cls)
    }


def _example_value(annotation) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return _example_value(next(a for a in args if a is not type(None)))
    if origin is list:
        return _example_value(args[0]) if args else "placeholder"
    if origin is typing.Literal:
        return str(args[0])
    return {int: "1", float: "1.0", bool: "true"}.get(annotation, "placeholder")


def is_placeholder(word: str) -> bool:
    return word == PLACEHOLDER or bool(re.fullmatch(r"[A-Z][A-Z0-9_]*", word))


def filled(command: str, args: list[str], tmp_path: Path) -> list[str]:
    """The docs' shorthand made concrete (see the module docstring)."""
    types_ = _field_types(command)
    out: list[str] = []
    flag = None
    for i, word in enumerate(args):
        if word == "...":
            continue
        if word.startswith("--"):
            flag = word[2:].split("=")[0].replace("-", "_")
        if is_placeholder(word):
            word = _example_value(types_[flag]) if flag in types_ else "placeholder"
        elif PLACEHOLDER in word:
            word = word.replace(PLACEHOLDER, "placeholder")
        if i == 0 and word.endswith((".yaml", ".yml")) and not (ROOT / word).is_file():
            empty = tmp_path / "empty.yaml"
            empty.write_text("{}\n")
            word = str(empty)
        out.append(word)
    return out


def collected() -> list[Line]:
    return [line for page in PAGES for line in doc_lines(page) if swiftlm_argvs(line)]


@pytest.fixture
def entry(monkeypatch, tmp_path):
    """`main` up to the command's start: returns (exit code, stderr) for an argument list."""
    import swiftlm.cli.main as cli
    import swiftlm.config.outputs as outputs
    import swiftlm.config.paths as paths
    from swiftlm.plugins import loading

    started = []
    monkeypatch.setattr(paths, "check_input_kinds", lambda cfg: None)
    monkeypatch.setattr(outputs, "check_outputs", lambda cfg: None)
    monkeypatch.setattr(cli, "quiet_libraries", lambda: None)
    monkeypatch.setattr(cli, "wants_launch", lambda dist_args: False)
    runner = types.SimpleNamespace(run=lambda cfg, *method: started.append(cfg))
    monkeypatch.setattr(cli, "importlib", types.SimpleNamespace(import_module=lambda _: runner))
    real_load = loading.load_plugins
    monkeypatch.setattr(
        cli, "load_plugins", lambda files: real_load([f for f in files if Path(f).is_file()])
    )
    stub = tmp_path / "docs_plugins.py"
    stub.write_text(STUB_PLUGIN)
    example = ROOT / "examples" / "plugin_package" / "swiftlm_demo_plugin" / "__init__.py"
    with fresh_registries():
        real_load([str(example), str(stub)], entry_points=False, log=lambda _: None)

        def call(argv: list[str]) -> tuple[int, str]:
            try:
                code = cli.main(argv)
            except SystemExit as exc:  # argparse: a bad value, or --help
                code = exc.code
            return code, ""

        yield call, started


def test_the_docs_hold_command_lines_of_every_command():
    from swiftlm.cli.main import COMMANDS

    seen = {argv[0] for line in collected() for argv in swiftlm_argvs(line) if argv}
    assert set(COMMANDS) <= seen | {PLACEHOLDER}, sorted(set(COMMANDS) - seen)
    assert len(collected()) >= 50  # a floor: extraction still finds the docs' commands


def test_every_docs_command_line_parses(entry, capsys, tmp_path):
    from swiftlm.cli.main import COMMANDS

    call, started = entry
    failures = []
    checked = 0
    for line in collected():
        for args in swiftlm_argvs(line):
            if not args or args[0] in HELP | VERSION:
                commands, rest = [None], args
            elif is_placeholder(args[0]):  # `swiftlm <command> --help`
                commands, rest = list(COMMANDS), args[1:]
            else:
                commands, rest = [args[0]], args[1:]
            for command in commands:
                if command is not None and command not in COMMANDS:
                    failures.append(f"{line.where}: `{line.text}`: unknown command {command}")
                    continue
                argv = [command, *filled(command, rest, tmp_path)] if command else args
                before = len(started)
                capsys.readouterr()
                code, _ = call(argv)
                err = capsys.readouterr().err
                checked += 1
                asks_help = bool(set(argv[1:]) & HELP) or not command
                ok = code == 0 and (asks_help or len(started) == before + 1)
                if ok:
                    continue
                if line.shown_error and line.shown_error in err:
                    continue  # fails as the docs show
                failures.append(f"{line.where}: `{line.text}` -> {argv}: exit {code}: {err}")
    assert not failures, "\n".join(failures)
    assert checked >= 60
