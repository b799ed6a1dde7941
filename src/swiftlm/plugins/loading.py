"""Load plugins: installed packages' `swiftlm.plugins` entry points, then `--external_plugins`
files, once per process, before a command's flags are parsed (a plugin may add names that
the parser checks, e.g. `--reward_funcs`). Every failure is a PluginError naming the plugin.

An entry point names a module (`pkg.plugin`: importing it registers; a top-level `register()`
function, if any, is then called) or a callable (`pkg.plugin:register`, called with no
arguments). A file is imported as a module the same way. A module may set
`SWIFTLM_API_VERSION = "1.0"` (or call `require_api`) to declare the API it needs.
"""

import importlib.metadata
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from types import ModuleType

import yaml

from swiftlm.config.paths import PLUGIN_FILE, check_input_path
from swiftlm.distributed.failures import failure_dir
from swiftlm.errors import ConfigError
from swiftlm.plugins.context import PluginError, loading, require_api
from swiftlm.plugins.guards import SWIFTLM_DIR, where

ENTRY_POINT_GROUP = "swiftlm.plugins"
FLAG = "external_plugins"

_loaded: list[str] = []  # labels of the plugins loaded in this process, in order
_files_done: set[Path] = set()
_entry_points_done = False


def loaded_plugins() -> list[str]:
    """The plugins loaded in this process, in load order (entry points first)."""
    return list(_loaded)


def plugin_files(argv: list[str]) -> list[str]:
    """The `--external_plugins` files of a command line: from its flags and from its YAML
    config file (the first argument; `external_plugins:` flat or under `plugins:`)."""
    files: list[str] = []
    if argv and argv[0].endswith((".yaml", ".yml")):
        files += _yaml_plugin_files(Path(argv[0]))
    taking = False
    for arg in argv:
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if arg.startswith("--"):
            taking = name.replace("-", "_") == FLAG
            if taking and eq:
                files.append(value)
                taking = False
        elif taking:
            files.append(arg)
    return files


def _yaml_plugin_files(path: Path) -> list[str]:
    """The YAML file's plugin files; nothing when it cannot be read (parsing says why later)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return []
    if not isinstance(data, dict):
        return []
    section = data.get("plugins")
    value = section.get(FLAG) if isinstance(section, dict) else data.get(FLAG)
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value] if isinstance(value, list) else []


def load_plugins(files: list[str] = (), entry_points: bool = True, log=None) -> list[str]:
    """Load the installed entry points (once) and each file not loaded yet; return the labels
    of the plugins this call loaded, and print one line listing them (rank 0 only)."""
    global _entry_points_done
    new: list[str] = []
    if entry_points and not _entry_points_done:
        _entry_points_done = True
        for entry_point in _group_entry_points():
            new.append(_load_entry_point(entry_point))
    for file in files:
        path = Path(file).expanduser().resolve()
        if path not in _files_done:
            _files_done.add(path)
            new.append(_load_file(file, path))
    _loaded.extend(new)
    # Once per job: not by torchrun's other ranks, nor by the workers of swiftlm's launcher,
    # which loaded (and listed) the same plugins before it started them.
    if new and os.environ.get("RANK", "0") == "0" and failure_dir() is None:
        (log or _print)(f"swiftlm: loaded plugins: {'; '.join(new)}")
    return new


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _group_entry_points() -> list:
    found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    unique = {(ep.name, ep.value): ep for ep in found}  # a path listed twice finds it twice
    return sorted(unique.values(), key=lambda ep: ep.name)


def _entry_point_label(entry_point) -> str:
    dist = getattr(entry_point, "dist", None)
    where = f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"
    return f"entry point '{entry_point.name}' = {entry_point.value} ({where})"


def _load_entry_point(entry_point) -> str:
    label = _entry_point_label(entry_point)
    with loading(label):
        try:
            target = entry_point.load()
        except PluginError as exc:
            raise _located(exc) from None
        except Exception as exc:
            raise PluginError(f"{label}: importing it failed at {_failure(exc)}") from exc
        _register(target, label)
    return label


def _load_file(file: str, path: Path) -> str:
    label = f"plugin file {path}"
    with loading(label):
        if not path.exists():
            raise PluginError(
                f"--external_plugins {file}: the file {path} does not exist; give the path "
                f"of {PLUGIN_FILE.takes}"
            )
        # A folder or a .txt here would otherwise reach importlib, which has no loader for it.
        try:
            check_input_path(file, "--external_plugins", PLUGIN_FILE)
        except ConfigError as exc:
            raise PluginError(str(exc)) from None
        module_name = f"swiftlm_external_plugin_{path.stem}_{len(_files_done)}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except PluginError as exc:
            raise _located(exc) from None
        except SyntaxError as exc:
            raise PluginError(
                f"{label}: syntax error at {exc.filename}:{exc.lineno}: {exc.msg}"
            ) from None
        except Exception as exc:
            raise PluginError(f"{label}: importing it failed at {_failure(exc)}") from exc
        _register(module, label)
    return label


def _located(exc: PluginError) -> PluginError:
    """A registration error with the plugin's line that made the bad call, e.g. `(at
    /path/plugin.py:12)`, unless the message already names a line."""
    site = where(exc)
    if site.startswith(SWIFTLM_DIR) or site in str(exc):
        return exc
    return PluginError(f"{exc} (at {site})")


def _failure(exc: BaseException) -> str:
    if isinstance(exc, SyntaxError):
        return f"{exc.filename}:{exc.lineno}: SyntaxError: {exc.msg}"
    return f"{where(exc)}: {type(exc).__name__}: {exc}"


def _register(target, label: str) -> None:
    """Check a module's declared API version and call its `register()` (or the entry point's
    callable)."""
    if isinstance(target, ModuleType):
        version = getattr(target, "SWIFTLM_API_VERSION", None)
        if version is not None:
            require_api(version)
        target = getattr(target, "register", None)
        if target is None:
            return
    if not callable(target):
        raise PluginError(f"{label}: `register` is not callable ({type(target).__name__})")
    try:
        inspect.signature(target).bind()
    except TypeError:
        raise PluginError(
            f"{label}: register{inspect.signature(target)} must take no arguments"
        ) from None
    except ValueError:
        pass
    try:
        target()
    except PluginError as exc:
        raise _located(exc) from None
    except Exception as exc:
        raise PluginError(f"{label}: register() failed at {_failure(exc)}") from exc
