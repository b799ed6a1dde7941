"""Plugin code wrapped so that its failures name the plugin: signature checks when it is
registered, and exceptions at run time turned into a PluginError with the plugin's file and
line. swiftlm's own errors (ConfigError, DataError, a row's RowError) pass through: a plugin
may raise them on purpose."""

import functools
import inspect
import traceback
from collections.abc import Callable
from pathlib import Path

from swiftlm.data.rows import RowError
from swiftlm.errors import SwiftLMError
from swiftlm.plugins.context import PluginError

# swiftlm's own source folder: frames in it are not where a plugin failed.
SWIFTLM_DIR = str(Path(__file__).resolve().parents[1])


def where(exc: BaseException, plugin_file: str | None = None) -> str:
    """`file:line` where a plugin failed: the innermost frame in `plugin_file` (the file of
    the registered function), else the innermost one outside swiftlm itself."""
    every = traceback.extract_tb(exc.__traceback__)
    mine = [frame for frame in every if plugin_file and frame.filename == plugin_file]
    outside = [frame for frame in every if not frame.filename.startswith(SWIFTLM_DIR)]
    frame = (mine or outside or every)[-1]
    return f"{frame.filename}:{frame.lineno}"


def guarded(function: Callable, what: str, owner: str) -> Callable:
    """`function`, raising a PluginError that names `what` (e.g. "loss 'focal'") and its
    `owner` plugin when it raises anything but a swiftlm error or a RowError."""

    try:
        plugin_file = inspect.getsourcefile(function)
    except TypeError:
        plugin_file = None

    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except (SwiftLMError, RowError):
            raise
        except Exception as exc:
            raise PluginError(
                f"{what} of {owner} failed at {where(exc, plugin_file)}: {type(exc).__name__}: {exc}"
            ) from exc

    call.plugin_owner = owner
    return call


def check_callable(
    function, what: str, owner: str, *args, needs_kwargs: bool = False, **kwargs
) -> None:
    """Refuse a registration whose function cannot be called the way swiftlm calls it."""
    if not callable(function):
        raise PluginError(f"{owner}: {what} must be callable, got {type(function).__name__}")
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    kinds = {p.kind for p in signature.parameters.values()}
    if needs_kwargs and inspect.Parameter.VAR_KEYWORD not in kinds:
        raise PluginError(
            f"{owner}: {what} has the signature {signature}; it must accept **kwargs (swiftlm "
            "passes the row's other columns as keyword arguments)"
        )
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise PluginError(
            f"{owner}: {what} has the wrong signature {signature} ({exc}); swiftlm calls it as "
            f"{_shown_call(args, kwargs)}"
        ) from None


def _shown_call(args: tuple, kwargs: dict) -> str:
    shown = [f"<{name}>" for name in args] + [f"{key}=..." for key in kwargs]
    return f"fn({', '.join(shown)})"
